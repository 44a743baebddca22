"""Lazy capture: a key is captured after the first step that needs it ran eagerly at its
padded shapes; a memory limit stops capturing and leaves the rest eager, reported."""

import logging

import numpy as np
import pytest
import torch

from graphattn import GraphRunner, RunnerConfig, SchedulerOutput
from graphattn.buckets import BucketPolicy
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState
from graphattn.sync import no_host_sync

PROMPTS = [[5, 3, 9, 1, 7], [2, 8, 8, 4, 6, 1, 9, 3, 3, 7, 2]]


def make(device="cpu", compile=False, **config):
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32)).to(device)
    st = RequestState(4, 64, 8, device)
    model.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    policy = BucketPolicy(capture_sizes=(1, 2, 4), length_boundaries=(32,),
                          mixed_token_sizes=(16,))
    return st, GraphRunner(model, st, RunnerConfig(policy=policy, compile=compile, **config))


def serve(runner, steps=6):
    """Prefill both prompts, then decode; returns (tokens, [(key, replayed)] per step)."""
    st = runner.state
    slots = np.array([runner.add_request(f"r{i}", p) for i, p in enumerate(PROMPTS)], np.int32)
    tokens, seen = [], []
    scheds = [SchedulerOutput(slots, np.array([len(p) for p in PROMPTS]))]
    scheds += [SchedulerOutput(slots[:1], np.ones(1, np.int32))] * 2
    scheds += [SchedulerOutput(slots, np.ones(2, np.int32))] * steps
    for sched in scheds:
        with no_host_sync():
            out = runner.step(sched)
        tokens.append(out.sampled.tolist())
        seen.append((out.key, out.replayed))
    assert st.num_active == 2
    return tokens, seen


@pytest.mark.parametrize("compile", [False, True], ids=["eager_model", "compiled"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_each_key_runs_eagerly_once_then_replays(device, compile, caplog):
    _, eager = make(device)
    want, _ = serve(eager)
    _, runner = make(device, compile=compile, lazy_capture=True)
    with caplog.at_level(logging.INFO, logger="graphattn"):
        got, seen = serve(runner)
    assert got == want
    first = {}
    for key, replayed in seen:
        assert replayed == (key in first)  # the first step of a key eager, later ones replay
        first.setdefault(key, replayed)
    report = runner.lazy_report
    assert report.keys == list(first) and report.num_graphs == len(first) == 3
    assert len(report.key_seconds) == 3 and all(s > 0 for s in report.key_seconds)
    assert sum("lazily" in r.message for r in caplog.records) == 3
    assert set(runner.graphs.keys) == set(first)


def test_memory_limit_leaves_later_keys_eager_and_reports_them(monkeypatch, caplog):
    _, eager = make()
    want, _ = serve(eager)
    _, runner = make(lazy_capture=True, graph_memory_limit=1 << 20)
    sizes = iter([0, 1 << 19, 1 << 20])  # before and after the first capture, then full

    monkeypatch.setattr(runner.graphs, "pool_bytes", lambda: next(sizes, 1 << 20))
    with caplog.at_level(logging.INFO, logger="graphattn"):
        got, seen = serve(runner)
    assert got == want
    report = runner.lazy_report
    assert report.num_graphs == 1 and len(report.over_budget) == 2
    over = set(report.over_budget)
    assert not any(replayed for key, replayed in seen if key in over)
    assert sum("graph_memory_limit" in r.message for r in caplog.records) == 2


def test_capture_stops_at_the_memory_limit(monkeypatch):
    _, runner = make(graph_memory_limit=100)
    sizes = iter([0, 60, 60, 120])  # before and after each capture
    monkeypatch.setattr(runner.graphs, "pool_bytes", lambda: next(sizes, 120))
    report = runner.capture(progress=False)
    assert report.num_graphs == 2 and len(report.over_budget) >= 1
    assert "over the memory limit" in str(report)
    assert not set(report.over_budget) & set(runner.graphs.keys)


def test_lazy_capture_is_validated():
    with pytest.raises(ValueError, match="lazy_capture needs on_missing = 'eager'"):
        RunnerConfig(lazy_capture=True, on_missing="error")
    with pytest.raises(ValueError, match="graph_memory_limit = -1"):
        RunnerConfig(graph_memory_limit=-1)
