"""`bench.warm_start`: a cold and a warm start in fresh processes sharing one compile cache."""

import json
import sys

import pytest

from bench import warm_start
from graphattn.artifacts import aot_compile_available


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--regions", "blocks"), *(pytest.param(
    a, marks=pytest.mark.skipif(not aot_compile_available(),
                                reason="this torch does not save compiled functions"))
    for a in (("--artifacts",), ("--artifacts", "--regions", "blocks")))])
def test_cold_and_warm_start_rows(tmp_path, monkeypatch, extra):
    """The three starts' rows; with --artifacts the warm start compiles nothing: it loads the
    step (or the layers' shared function) and prepare's device half the cold start saved;
    with --regions blocks the layers compile as often as the whole step does."""
    artifacts = "--artifacts" in extra
    monkeypatch.setattr(sys, "argv", [
        "warm_start", "--model", "tiny", "--max-reqs", "2", "--max-len", "64", "--mixed", "",
        "--dynamic", "--warm-compile-threads", "1", "--cache-dir", str(tmp_path / "cache"),
        "--out", str(tmp_path), *extra])
    warm_start.main()
    tag = ("_aot" if artifacts else "") + ("_blocks" if "blocks" in extra else "")
    name = f"warm_start_cpu_tiny_2_dynamic{tag}_warm1.json"
    result = json.loads((tmp_path / name).read_text())
    first, cold, warm = result["rows"]
    assert (first["start"], cold["start"], warm["start"]) == ("first", "cold", "warm")
    assert (first["compile_threads"], cold["compile_threads"], warm["compile_threads"]) == (
        None, None, 1)
    assert first["compiles"] == cold["compiles"]  # the first start's compile cache is apart
    # keys of 1 and 2 rows: one compile of the step serves both
    assert cold["keys"] == warm["keys"] == 2 and cold["compiles"] == 1
    assert warm["compiles"] == (0 if artifacts else 1)
    assert warm["loaded"] == (cold["all_compiles"] if artifacts else 0)
    for row in (first, cold, warm):
        assert row["seconds"] == pytest.approx(row["first_key_s"] + row["other_keys_s"])
        assert [k[:3] for k in row["key_s"]] == [[2, 2, True], [1, 1, True]]
        assert 0 < sum(k[3] for k in row["key_s"]) <= row["seconds"]
        assert row["triton_first_key"] == row["triton_all_keys"] == {}  # no kernel on CPU
    assert "--dynamic" in result["meta"]["command"]
    assert any((tmp_path / "cache").iterdir())  # the compile cache the warm start read


def test_triton_compiles_are_counted_by_kernel_and_the_hooks_put_back():
    """`triton_compiles` counts each JIT compile between Triton's cache-miss and
    post-compile hooks by kernel name, and restores the hooks it replaced."""
    knobs = pytest.importorskip("triton").knobs
    if not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no JIT compile hooks")
    from triton.runtime.jit import JitFunctionInfo

    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    fn = JitFunctionInfo(None, "kernel", None)
    with warm_start.triton_compiles() as found:
        for key in ("a", "b"):
            assert knobs.runtime.jit_cache_hook(key=key, fn=fn, repr="") is False
            assert knobs.runtime.jit_post_compile_hook(key=key, fn=fn, repr="") is False
    assert list(found) == ["kernel"] and found["kernel"][0] == 2 and found["kernel"][1] >= 0
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
