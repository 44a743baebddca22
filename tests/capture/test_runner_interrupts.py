"""An interrupt at any line of `GraphRunner.step()` or `apply_feedback()` leaves the runner
usable and the CPU mirror >= the device truth, and once recovered (`resync()` when the
exception says the step counts, else the same call again) it matches a runner that was
never interrupted: tokens, truth, mirror and KV cache.

Every line event in the library's frames (and in the context managers it enters) of one
call is counted under `sys.settrace`; the call is then repeated once per line, with a
KeyboardInterrupt raised at that line.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.fx.experimental._config

from bench.workload import device_truth
from graphattn import GraphRunner, RunnerConfig, StepOutput
from graphattn.buckets import BucketPolicy
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState, SchedulerOutput

ROOT = Path(__file__).resolve().parents[2]
TRACED = (str(ROOT / "graphattn"), str(ROOT / "capture"), contextlib.__file__,
          str(Path(torch.__file__).parent / "autograd" / "grad_mode.py"),
          str(Path(torch.__file__).parent / "utils" / "_contextlib.py"))
PROMPT = 12


@pytest.fixture(autouse=True)
def _restore_compile_settings():
    """Interrupts land in contextlib's frames too, also while a block of dynamo's settings
    (a piecewise compile's dynamic-shape config) unwinds, which can leave a setting patched
    for the process: put dynamo's and the shape environment's settings back afterwards, so
    later tests compile as in a fresh process."""
    configs = (torch._dynamo.config, torch.fx.experimental._config)
    saved = [c.get_config_copy() for c in configs]
    yield
    for c, values in zip(configs, saved, strict=True):
        for k, v in values.items():
            if getattr(c, k) != v:
                setattr(c, k, v)


class LineInterrupt:
    """Count line events of traced files; raise KeyboardInterrupt at the `at`-th."""

    def __init__(self, at: int | None = None) -> None:
        self.at, self.count, self.where = at, 0, None

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename.startswith(TRACED) else None

    def _local(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.count == self.at:
                self.where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
                raise KeyboardInterrupt(self.where)
        return self._local

    def __enter__(self):
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)


def make_runner(cudagraph_mode: str = "full") -> GraphRunner:
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32)).double()
    st = RequestState(3, 64, 8)
    model.allocate_caches(st.num_kv_blocks, 8)
    policy = BucketPolicy(capture_sizes=(2, 4), decode_query_len=2, length_boundaries=(32,),
                          mixed_token_sizes=(16,), piecewise_token_sizes=(8, 16))
    runner = GraphRunner(model, st, RunnerConfig(policy=policy, cudagraph_mode=cudagraph_mode))
    runner.capture(progress=False)
    return runner


class Pair:
    """A runner that gets interrupted and one that never does, driven alike."""

    def __init__(self, cudagraph_mode: str) -> None:
        self.a, self.b = make_runner(cudagraph_mode), make_runner(cudagraph_mode)
        self.rng = np.random.default_rng(0)
        self.n = 0

    def schedule(self, kind: str) -> tuple[SchedulerOutput, list[int] | None]:
        """A schedule of `kind` ("prefill", "decode" or "spec") on fresh requests when the
        live ones cannot take it."""
        st = self.b.state
        slots = np.flatnonzero(st.active_np).astype(np.int32)
        computed = st.num_computed_tokens_np[slots]
        if kind == "prefill" or not slots.size or (computed < PROMPT).any() or (
                computed.max() + 3 > st.max_model_len):
            self._renew()
            slots = np.flatnonzero(st.active_np).astype(np.int32)
            if kind == "prefill":
                return SchedulerOutput(slots, np.full(slots.size, 5)), None
            run_both(self, SchedulerOutput(slots, np.full(slots.size, PROMPT)), None)
        if kind == "decode":
            return SchedulerOutput(slots, np.ones(slots.size, np.int32)), None
        drafts = self.rng.integers(0, 64, slots.size)
        one = np.ones(slots.size, np.int32)
        return SchedulerOutput(slots, one + 1, one), list(drafts)

    def _renew(self) -> None:
        for r in (self.a, self.b):
            for req in list(r.state.req_id_to_slot):
                r.state.remove_request(req)
        for _ in range(2):
            prompt = self.rng.integers(0, 64, PROMPT)
            for r in (self.a, self.b):
                r.add_request(f"r{self.n}", prompt)
            self.n += 1

    def assert_same(self) -> None:
        a, b = self.a.state, self.b.state
        np.testing.assert_array_equal(a.num_computed_tokens_np, b.num_computed_tokens_np)
        np.testing.assert_array_equal(device_truth(a), device_truth(b))
        np.testing.assert_array_equal(a.num_pending_drafts_np, b.num_pending_drafts_np)
        assert torch.equal(self.a.token_ids, self.b.token_ids)
        for ca, cb in zip(self.a.forward.caches, self.b.forward.caches, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(ca, cb, strict=True))


def count_lines(call) -> int:
    with LineInterrupt() as counter:
        call()
    return counter.count


def recover_step(runner: GraphRunner, err: KeyboardInterrupt, before: np.ndarray,
                 sched: SchedulerOutput, drafts) -> StepOutput | None:
    """Check what an interrupted step left (`before`: the mirror and the truth before it),
    then finish it as a caller would: the output of the step run again, or None."""
    st = runner.state
    assert not torch.is_inference_mode_enabled()
    truth = device_truth(st)
    assert (st.num_computed_tokens_np >= truth).all(), (st.num_computed_tokens_np, truth)
    if any("so it counts" in n for n in getattr(err, "__notes__", ())):
        runner.resync()
    else:  # nothing happened
        np.testing.assert_array_equal(st.num_computed_tokens_np, before[0])
        np.testing.assert_array_equal(truth, before[1])
    if (device_truth(st) == before[1]).all():
        return runner.step(sched, draft_token_ids=drafts)
    return None


def run_both(pair: Pair, sched: SchedulerOutput, drafts) -> list[StepOutput]:
    """The same step on both runners, with its feedback applied."""
    outs = [r.step(sched, draft_token_ids=drafts) for r in (pair.a, pair.b)]
    for r, out in zip((pair.a, pair.b), outs, strict=True):
        if out.feedback is not None:
            r.apply_feedback(out)
    return outs


KINDS = [("full", "prefill"), ("full", "decode"), ("full", "spec"), ("piecewise", "prefill")]


@pytest.mark.parametrize("mode,kind", KINDS)
def test_an_interrupt_at_any_line_of_step(mode, kind):
    pair = Pair(mode)
    sched, drafts = pair.schedule(kind)
    lines = count_lines(lambda: pair.a.step(sched, draft_token_ids=drafts))
    pair.a.state.resync()  # its feedback is not applied
    pair.b.step(sched, draft_token_ids=drafts)
    pair.b.state.resync()
    assert lines > 500
    for at in range(1, lines + 1):
        sched, drafts = pair.schedule(kind)
        out_b = pair.b.step(sched, draft_token_ids=drafts)
        st = pair.a.state
        before = st.num_computed_tokens_np.copy(), device_truth(st)
        try:
            with LineInterrupt(at):
                out_a = pair.a.step(sched, draft_token_ids=drafts)
        except KeyboardInterrupt as err:
            out_a = recover_step(pair.a, err, before, sched, drafts)
        for runner, out in ((pair.a, out_a), (pair.b, out_b)):
            if out is not None and out.feedback is not None:
                runner.apply_feedback(out)
        pair.assert_same()


def test_an_interrupt_at_any_line_of_apply_feedback():
    pair = Pair("full")
    sched, drafts = pair.schedule("spec")
    outs = [r.step(sched, draft_token_ids=drafts) for r in (pair.a, pair.b)]
    lines = count_lines(lambda: pair.b.apply_feedback(outs[1]))
    pair.a.apply_feedback(outs[0])
    assert lines > 30
    for at in range(1, lines + 1):
        sched, drafts = pair.schedule("spec")
        out_a, out_b = (r.step(sched, draft_token_ids=drafts) for r in (pair.a, pair.b))
        pair.b.apply_feedback(out_b)
        try:
            with LineInterrupt(at):
                pair.a.apply_feedback(out_a)
        except KeyboardInterrupt:
            st = pair.a.state
            assert (st.num_computed_tokens_np >= device_truth(st)).all()
            result = pair.a.apply_feedback(out_a)  # applies, or says it had been applied
            assert (result.applied | result.duplicate).all()
        pair.assert_same()
