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


def test_size_options_add_to_the_global_ones_for_their_token_count():
    cfg = CompileConfig(enabled=True, options={"coordinate_descent_tuning": True},
                        size_options={1: "max-autotune-no-cudagraphs", 8: {"max_autotune": False}})
    one = cfg.inductor_options(1)
    assert one["max_autotune"] is True and one["coordinate_descent_tuning"] is True
    assert one["triton.cudagraphs"] is False
    assert cfg.inductor_options(8)["max_autotune"] is False
    assert "max_autotune" not in cfg.inductor_options(4) == cfg.inductor_options()
    for bad, match in (({0: "default"}, "CompileConfig.size_options key = 0, expected >= 1"),
                       ({1: "fastest"}, r"CompileConfig.size_options\[1\] = 'fastest' is not "
                                        "an inductor mode"),
                       ({1: 3}, r"CompileConfig.size_options\[1\] must be an inductor mode "
                                "name or a mapping of options, got int"),
                       ([1], "CompileConfig.size_options must be a mapping, got list")):
        with pytest.raises(ValueError, match=match):
            CompileConfig(enabled=True, size_options=bad)
    with pytest.raises(ValueError, match="CompileConfig.size_options needs backend 'inductor'"):
        CompileConfig(enabled=True, backend="eager", size_options={1: {}})
