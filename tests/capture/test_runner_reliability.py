"""A runner step takes effect whole or not at all, and bad input is refused before anything
changes (each case reproduces a defect found by an adversarial run)."""

import threading

import numpy as np
import pytest
import torch

from bench.workload import device_truth
from graphattn import GraphRunner, RunnerConfig
from graphattn.buckets import BucketPolicy
from graphattn.capture.graphs import GraphNotCapturedError
from graphattn.capture.profiling import StageProfiler
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState, SchedulerOutput


class Interrupt(Exception):
    pass


class FlakyProfiler(StageProfiler):
    """Raises at a chosen range enter or exit (a fault or Ctrl-C anywhere in a step)."""

    def __init__(self):
        super().__init__(nvtx_ranges=False, torch_labels=False)
        self.fail_at = None
        self.count = 0

    def range(self, stage, key=None):
        prof = self

        class R:
            def __enter__(self):
                prof._tick()

            def __exit__(self, *exc):
                prof._tick()

        return R()

    def _tick(self):
        self.count += 1
        if self.count == self.fail_at:
            raise Interrupt(f"at event {self.count}")


def make(policy=None, **kw):
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32)).double()
    st = RequestState(4, 64, 8)
    model.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    policy = policy or BucketPolicy(capture_sizes=(2, 4), length_boundaries=(32,),
                                    mixed_token_sizes=(16,))
    extra = {k: kw.pop(k) for k in ("profiler", "proposer", "builder", "dispatcher") if k in kw}
    return model, st, GraphRunner(model, st, RunnerConfig(policy=policy, **kw), **extra)


def test_interrupted_steps_leave_mirror_equal_to_truth():
    model, st, runner = make(profiler=FlakyProfiler())
    runner.capture(progress=False)
    prof = runner.profiler
    rng = np.random.default_rng(0)
    prompts = {runner.add_request(f"r{i}", rng.integers(0, 64, 12)): 12 for i in range(3)}
    slots = np.array(sorted(prompts), np.int32)
    interrupted = 0
    for step in range(60):
        left = st.num_prompt_tokens_np[slots] - st.num_computed_tokens_np[slots]
        sched = SchedulerOutput(slots, np.where(left > 0, np.minimum(left, 5), 1))
        if st.num_computed_tokens_np[slots].max() + 5 >= st.max_model_len:
            break
        prof.count, prof.fail_at = 0, int(rng.integers(1, 12)) if step % 2 else None
        forward = runner.forward
        if step % 7 == 3:  # a fault inside the model itself
            def boom(*a, **k):
                raise Interrupt("forward")
            runner.forward = boom
        try:
            runner.step(sched)
        except Interrupt:
            interrupted += 1
        finally:
            runner.forward = forward
        np.testing.assert_array_equal(st.num_computed_tokens_np[slots], device_truth(st)[slots])
    assert interrupted > 10


def test_prompt_ids_validated_before_any_change():
    _, st, runner = make()
    for ids, match in [([[1, 2]], r"must be a 1-D integer sequence, got shape \(1, 2\)"),
                       ([1, 64], r"ids \[64\] are outside \[0, vocab_size=64\]"),
                       ([-3, 1], r"ids \[-3\] are outside"),
                       ([0.5], "1-D integer sequence")]:
        with pytest.raises(ValueError, match=match):
            runner.add_request("x", ids)
        assert st.num_active == 0 and "x" not in st.req_id_to_slot


def test_bad_slot_gets_the_schedule_error():
    _, st, runner = make()
    runner.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match=r"req_slots must be in \[0, 4\), got min 9 max 9"):
        runner.step(SchedulerOutput(np.array([9]), np.array([1])))


def test_prefix_hit_admission_resets_the_slot():
    model, st, runner = make()
    prompt = list(range(1, 20))
    a = runner.add_request("a", prompt)
    runner.step(SchedulerOutput(np.array([a]), np.array([19])))  # KV of the prompt cached
    st.remove_request("a")
    b = runner.add_request("b", prompt + [7, 9], num_computed_tokens=19)  # same slot, blocks
    assert b == a and st.num_computed_tokens_np[b] == 19
    # nothing of a's (its sampled token at position 19) survives past b's prompt
    assert runner.token_ids[b, 21:].abs().sum().item() == 0
    out = runner.step(SchedulerOutput(np.array([b]), np.array([2])))
    ref = model.reference_logits(torch.tensor(prompt + [7, 9]))[-1]
    torch.testing.assert_close(out.logits[0], ref, rtol=1e-9, atol=1e-9)


def test_concurrent_step_refused():
    model, st, runner = make()
    runner.add_request("a", [1, 2, 3])
    sched = SchedulerOutput(np.array([0]), np.array([1]))
    errors = _during_forward(runner, lambda: runner.step(sched))
    runner.step(SchedulerOutput(np.array([0]), np.array([3])))
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "already running in another thread" in str(errors[0])
    np.testing.assert_array_equal(st.num_computed_tokens_np[:1], device_truth(st)[:1])


def _during_forward(runner, call):
    """Make the runner's forward run `call` from another thread; the errors it raised."""
    errors = []
    forward = runner.forward

    def slow_forward(inputs, meta):
        t = threading.Thread(target=lambda: errors.append(_try(call)))
        t.start()
        t.join()
        return forward(inputs, meta)

    runner.forward = slow_forward
    return errors


def _try(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return e
    return None


def test_on_missing_error_never_runs_eager():
    _, st, runner = make(on_missing="error")
    runner.capture(progress=False)
    runner.add_request("a", list(range(30)))
    with pytest.raises(GraphNotCapturedError, match="no graph key fits the batch"):
        runner.step(SchedulerOutput(np.array([0]), np.array([30])))  # 30 tokens > 16
    assert st.num_computed_tokens_np[0] == 0 and device_truth(st)[0] == 0
    runner.step(SchedulerOutput(np.array([0]), np.array([10])))  # fits the mixed key
    assert st.num_computed_tokens_np[0] == 10


def test_tokens_nobody_has_are_refused_before_anything_changes():
    """A decode row runs its last token plus its drafts, a prefill row the rest of its prompt:
    scheduling more would run positions on the token buffer's zeros."""
    _, st, runner = make()
    a = runner.add_request("a", [5, 9, 2, 7])
    with pytest.raises(ValueError, match=r"num_scheduled_tokens\[0\] = 5 .* expected <= 4 "
                                         r"\(prefill row"):
        runner.step(SchedulerOutput(np.array([a]), np.array([5])))
    runner.step(SchedulerOutput(np.array([a]), np.array([4])))
    with pytest.raises(ValueError, match=r"num_scheduled_tokens\[0\] = 3 .* expected <= 1 "
                                         r"\(decode row"):
        runner.step(SchedulerOutput(np.array([a]), np.array([3])))
    assert st.num_computed_tokens_np[a] == 4 and device_truth(st)[a] == 4
    runner.step(SchedulerOutput(np.array([a]), np.array([1])))
    assert st.num_computed_tokens_np[a] == 5


@pytest.mark.parametrize("params", [dict(top_k=2 ** 63), dict(temperature=True),
                                    dict(top_p=True), dict(top_k=True)])
def test_bad_sampling_params_never_admit_a_request(params):
    from graphattn import SamplingParams

    with pytest.raises(ValueError, match="top_k|temperature|top_p"):
        SamplingParams(**params)


def test_apply_feedback_from_a_second_thread_is_refused_while_a_step_runs():
    model, st, runner = make(policy=BucketPolicy(capture_sizes=(2, 4), decode_query_len=3,
                                                 length_boundaries=(32,),
                                                 mixed_token_sizes=(16,)))
    a = runner.add_request("a", [1, 2, 3])
    runner.step(SchedulerOutput(np.array([a]), np.array([3])))
    out = runner.step(SchedulerOutput(np.array([a]), np.array([3]), np.array([2])),
                      draft_token_ids=[4, 5])
    forward = runner.forward
    errors = _during_forward(runner, lambda: runner.apply_feedback(out))
    runner.step(SchedulerOutput(np.array([a]), np.array([1])), force_eager=True)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    runner.forward = forward
    assert runner.apply_feedback(out).applied.all()  # applied once the step is done
    np.testing.assert_array_equal(st.num_computed_tokens_np[:1], device_truth(st)[:1])


def test_interrupt_at_the_lock_leaves_the_runner_usable(monkeypatch):
    """An interrupt right after the runner is taken (before the step's body) releases it."""
    _, st, runner = make()
    a = runner.add_request("a", [1, 2, 3])
    calls = {"n": 0}
    real = st.batch_shape

    def interrupted(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(st, "batch_shape", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.step(SchedulerOutput(np.array([a]), np.array([3])))
    assert not torch.is_inference_mode_enabled()
    runner.step(SchedulerOutput(np.array([a]), np.array([3])))
    assert st.num_computed_tokens_np[a] == 3 and device_truth(st)[a] == 3


def test_caches_smaller_than_the_state_are_refused_when_wrapping():
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32))
    st = RequestState(4, 64, 8)
    model.allocate_caches(st.num_kv_blocks - 1, 8)
    with pytest.raises(ValueError, match=r"caches\[0\]: 32 blocks .* expected >= 33 blocks "
                                         r"\(the state's num_kv_blocks = 32"):
        GraphRunner(model, st)
    model.allocate_caches(st.num_kv_blocks, 4)
    with pytest.raises(ValueError, match="of 4 slots on cpu, expected .* of 8 slots"):
        GraphRunner(model, st)


@pytest.mark.parametrize("key", [(2, 2, 32, True), "reqs=2"])
def test_a_key_that_is_no_graph_key_is_refused(key):
    _, st, runner = make()
    a = runner.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="key must be a GraphKey"):
        runner.step(SchedulerOutput(np.array([a]), np.array([3])), key=key)
    assert st.num_computed_tokens_np[a] == 0


def test_runner_config_refuses_contradictions_and_bad_values():
    from graphattn import CompileConfig
    from graphattn.capture.dispatcher import GraphDispatcher

    _, st, runner = make()
    with pytest.raises(ValueError, match="give it or config.policy"):
        GraphRunner(runner.forward, st, RunnerConfig(policy=BucketPolicy(capture_sizes=(2,))),
                    dispatcher=runner.dispatcher)
    assert isinstance(runner.dispatcher, GraphDispatcher)
    for bad, match in ((dict(sampling=1), "RunnerConfig.sampling must be a bool"),
                       (dict(on_missing="skip"), "RunnerConfig.on_missing = 'skip'"),
                       (dict(cudagraph_mode="fullish"), "RunnerConfig.cudagraph_mode"),
                       (dict(policy=(1, 2)), "RunnerConfig.policy must be a BucketPolicy"),
                       (dict(vocab_size=0), "RunnerConfig.vocab_size = 0"),
                       (dict(compile="yes"), "RunnerConfig.compile must be")):
        with pytest.raises(ValueError, match=match):
            RunnerConfig(**bad)
    with pytest.raises(ValueError, match="CompileConfig.mode = 'max-autotune' needs backend"):
        CompileConfig(enabled=True, backend="eager", mode="max-autotune")
    assert RunnerConfig(compile=True).compile == CompileConfig(enabled=True)


def spec_runner():
    return make(policy=BucketPolicy(capture_sizes=(2, 4), decode_query_len=3,
                                    length_boundaries=(32,), mixed_token_sizes=(16,)))


def test_feedback_of_steps_applies_in_any_order():
    _, st, runner = spec_runner()
    a = runner.add_request("a", [1, 2, 3])
    runner.step(SchedulerOutput(np.array([a]), np.array([3])))
    sched = SchedulerOutput(np.array([a]), np.array([3]), np.array([2]))
    first = runner.step(sched, draft_token_ids=[60, 61])
    second = runner.step(sched, draft_token_ids=[62, 63])
    assert runner.apply_feedback(second).applied.all()
    assert runner.apply_feedback(first).applied.all()  # was refused as a duplicate
    assert st.num_pending_drafts_np[a] == 0
    np.testing.assert_array_equal(st.num_computed_tokens_np[:1], device_truth(st)[:1])
    assert runner.apply_feedback(first).duplicate.all()


def test_another_runners_output_is_refused():
    _, st_a, runner_a = spec_runner()
    _, st_b, runner_b = spec_runner()
    for r in (runner_a, runner_b):
        r.add_request("a", [1, 2, 3])
        r.step(SchedulerOutput(np.array([0]), np.array([3])))
    sched = SchedulerOutput(np.array([0]), np.array([3]), np.array([2]))
    out_a = runner_a.step(sched, draft_token_ids=[60, 61])
    runner_b.step(sched, draft_token_ids=[60, 61])
    before = st_b.num_computed_tokens_np.copy()
    with pytest.raises(ValueError, match="feedback of the state with uid"):
        runner_b.apply_feedback(out_a)
    np.testing.assert_array_equal(st_b.num_computed_tokens_np, before)


def test_an_interrupt_right_after_the_device_advance_counts_the_step(monkeypatch):
    """Ctrl-C just after the truth advanced: the step counts (the mirror keeps it and the
    exception says so); it never looks rolled back with the truth ahead of the mirror."""
    _, st, runner = make()
    a = runner.add_request("a", [1, 2, 3, 4])
    real = st.advance_device

    def advance_then_interrupt(*args):
        real(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(st, "advance_device", advance_then_interrupt)
    with pytest.raises(KeyboardInterrupt) as info:
        runner.step(SchedulerOutput(np.array([a]), np.array([4])))
    assert any("so it counts" in note for note in info.value.__notes__)
    assert st.num_computed_tokens_np[a] == 4 == device_truth(st)[a] and st.num_steps == 1
    monkeypatch.undo()
    runner.resync()
    out = runner.step(SchedulerOutput(np.array([a]), np.array([1])))
    assert st.num_computed_tokens_np[a] == 5 == device_truth(st)[a]
    assert out.sampled.shape == (1,)


def test_caches_of_another_dtype_or_layout_are_refused_when_wrapping():
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32)).double()
    st = RequestState(4, 64, 8)
    model.allocate_caches(st.num_kv_blocks, 8)
    model.float()  # cast after the caches were made
    with pytest.raises(ValueError, match=r"caches\[0\]: dtype torch.float64, expected the "
                                         r"model's torch.float32"):
        GraphRunner(model, st)
    model.allocate_caches(st.num_kv_blocks, 8)
    k, v = model.caches[0]
    model.caches[0] = (k.transpose(2, 3), v)  # a view the kernels would misread
    with pytest.raises(ValueError, match=r"caches\[0\]: strides .* expected a contiguous"):
        GraphRunner(model, st)


def test_default_blocks_avoid_blocks_given_to_another_request():
    _, st, runner = make()
    runner.add_request("x", [1, 2, 3], block_ids=range(8, 16))  # slot 0, slot 1's own range
    slot = runner.add_request("y", [1, 2, 3])
    assert slot == 1 and set(st.block_table_np[1]).isdisjoint(range(8, 16))
    runner.step(SchedulerOutput(np.array([0, 1]), np.array([3, 3])))


def test_an_empty_schedule_runs_without_mixed_keys():
    _, st, runner = make(policy=BucketPolicy(capture_sizes=(2, 4), length_boundaries=(32,),
                                             mixed_token_sizes=()))
    runner.capture(progress=False)
    empty = SchedulerOutput(np.array([], np.int32), np.array([], np.int32))
    assert runner.step(empty).key.uniform_decode  # a dummy run of the smallest key
    out = runner.step(empty, force_eager=True)
    assert out.key is None and out.sampled.shape == (0,) and len(out.sampled_host.wait()) == 0


def test_a_backend_the_model_cannot_run_is_refused_when_wrapping():
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32))
    st = RequestState(4, 64, 8)
    model.allocate_caches(st.num_kv_blocks, 8)
    with pytest.raises(ValueError, match=r"backend = 'flex' needs a FlexAttentionImpl, but "
                                         r"TinyDecoder.impl is a PagedAttentionImpl"):
        GraphRunner(model, st, RunnerConfig(backend="flex"))


@pytest.mark.parametrize("bad", ["shape", "dtype", "list"])
def test_a_proposer_returning_the_wrong_drafts_is_refused_when_wrapping(bad):
    class Proposer:
        def propose(self, token_ids, req_slots, last_positions, num_drafts):
            n = req_slots.shape[0]
            return {"shape": torch.zeros(n, num_drafts + 1, dtype=torch.int64),
                    "dtype": torch.zeros(n, num_drafts), "list": [0] * n}[bad]

    with pytest.raises(ValueError, match=r"Proposer.propose returned .*, expected an integer "
                                         r"tensor of shape \(1, 1\)"):
        make(proposer=Proposer(), policy=BucketPolicy(capture_sizes=(2,), decode_query_len=2))
