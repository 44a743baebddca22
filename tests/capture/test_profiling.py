import numpy as np
import pytest
import torch

from graphattn.capture.profiling import StageProfiler


def test_ranges_in_torch_profiler_trace():
    prof = StageProfiler()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        with prof.range("prepare"), prof.range("replay", "reqs=4"):
            torch.ones(4).sum()
    names = {e.name for e in p.events()}
    assert "graphattn::prepare" in names and "graphattn::replay reqs=4" in names


def test_nvtx_ranges_balanced_when_a_step_raises(monkeypatch):
    prof = StageProfiler()
    calls = []
    monkeypatch.setattr(prof.nvtx, "push_range", lambda attr: calls.append(("push", attr)))
    monkeypatch.setattr(prof.nvtx, "pop_range", lambda: calls.append(("pop",)))
    with pytest.raises(RuntimeError):
        with prof.range("build"), prof.range("replay", "k"):
            raise RuntimeError("boom")
    assert prof.depth == 0
    assert [c[0] for c in calls] == ["push", "push", "pop", "pop"]
    # one cached attributes object per (stage, key); None when no NVTX tool is attached
    assert calls[0][1] is prof.attributes("build", None)
    assert calls[1][1] is prof.attributes("replay", "k")
    assert set(prof._attributes) == {("build", None), ("replay", "k")}


def test_disabled_and_unknown_stage():
    off = StageProfiler(enabled=False)
    with off.range("anything"):
        pass
    with pytest.raises(ValueError, match="unknown stage 'nap'"):
        with StageProfiler().range("nap"):
            pass


def test_runner_emits_every_stage():
    from graphattn import BucketPolicy, GraphRunner, RunnerConfig
    from graphattn.models.tiny import TinyConfig, TinyDecoder
    from graphattn.state import RequestState, SchedulerOutput

    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32))
    st = RequestState(2, 32, 8)
    model.allocate_caches(8, 8)
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(capture_sizes=(2,))),
                         profiler=StageProfiler())
    runner.capture()
    runner.add_request("a", [1, 2])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        runner.step(SchedulerOutput(np.array([0]), np.array([2])))
        runner.step(SchedulerOutput(np.array([0]), np.array([1])))
    names = " ".join(e.name for e in p.events())
    for stage in ("dispatch", "prepare", "build", "eager", "replay", "postprocess"):
        assert f"graphattn::{stage}" in names
    assert "graphattn::replay reqs=2 tokens=2 len<=16 decode q=1" in names
