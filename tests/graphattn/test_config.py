"""RunnerConfig / CompileConfig: what each option turns into, and refusals that name the
option, the expected and the actual value."""

import pytest

import graphattn.config as config
from graphattn import CompileConfig


def test_pdl_turns_on_inductors_programmatic_dependent_launch():
    opts = CompileConfig(enabled=True, pdl=True).inductor_options()
    assert opts["triton.enable_pdl"] is True and opts["triton.cudagraphs"] is False
    assert "triton.enable_pdl" not in CompileConfig(enabled=True).inductor_options()
    # an explicit option wins over the flag
    opts = CompileConfig(enabled=True, pdl=True, options={"triton.enable_pdl": False})
    assert opts.inductor_options()["triton.enable_pdl"] is False


def test_pdl_is_refused_where_inductor_lacks_it(monkeypatch):
    monkeypatch.setattr(config, "inductor_has_pdl", lambda: False)
    with pytest.raises(ValueError, match="CompileConfig.pdl = True needs inductor's "
                                         "triton.enable_pdl, which torch .* lacks"):
        CompileConfig(enabled=True, pdl=True)
    with pytest.raises(ValueError, match="CompileConfig.pdl must be a bool"):
        CompileConfig(pdl="yes")


def test_compile_threads_reach_inductor_and_bad_counts_are_refused():
    opts = CompileConfig(enabled=True, compile_threads=1).inductor_options()
    assert opts["compile_threads"] == 1
    assert "compile_threads" not in CompileConfig(enabled=True).inductor_options()
    for bad, match in ((0, "CompileConfig.compile_threads = 0, expected >= 1"),
                       (2.0, "CompileConfig.compile_threads must be an integer")):
        with pytest.raises(ValueError, match=match):
            CompileConfig(enabled=True, compile_threads=bad)
