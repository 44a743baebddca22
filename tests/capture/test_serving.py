"""Serving-loop features of the runner: on-device sampling with per-request parameters,
tokens to the host through TokenFuture."""

import numpy as np
import pytest
import torch

from graphattn import CompileConfig, GraphRunner, RunnerConfig, SamplingParams
from graphattn.buckets import BucketPolicy
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import no_host_sync


def make(sampling=True, device="cpu", compile=False, overlap_copies=True):
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32)).to(device)
    st = RequestState(4, 64, 8, device)
    model.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    runner = GraphRunner(model, st, RunnerConfig(
        policy=BucketPolicy(capture_sizes=(2, 4), length_boundaries=(32,)), sampling=sampling,
        compile=compile, overlap_copies=overlap_copies))
    return st, runner


def generate(runner, st, params, steps, force_eager=False):
    slots = np.array([runner.add_request(f"r{i}", [1 + i, 2, 3], sampling=p)
                      for i, p in enumerate(params)], np.int32)
    runner.step(SchedulerOutput(slots, np.full(len(slots), 3)), force_eager=force_eager)
    out, logprobs = [], []
    for _ in range(steps):
        with no_host_sync():
            o = runner.step(SchedulerOutput(slots, np.ones(len(slots), np.int32)),
                            force_eager=force_eager)
        out.append(o.sampled_host.wait())
        logprobs.append(o.logprobs.clone())
        assert o.sampled_host.wait().dtype == np.int64
        assert torch.equal(torch.from_numpy(o.sampled_host.wait()), o.sampled.cpu())
    return np.stack(out), torch.stack(logprobs)


@pytest.mark.parametrize("compile", [False, True], ids=["eager_model", "compiled"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_seeded_requests_draw_the_same_tokens_on_replay_and_eager(device, compile):
    """Sampling runs inside the graph (compiled with the forward when compile=True)."""
    params = [SamplingParams(), SamplingParams(temperature=1.5, top_k=20, seed=7),
              SamplingParams(temperature=0.9, top_p=0.9, seed=11)]
    st, runner = make(device=device, compile=compile)
    runner.capture(progress=False)
    replayed, lp = generate(runner, st, params, 12)
    st2, eager = make(device=device)
    eager_tokens, _ = generate(eager, st2, params, 12, force_eager=True)
    np.testing.assert_array_equal(replayed, eager_tokens)
    assert len(set(replayed[:, 1].tolist())) > 2  # it does sample
    assert (lp <= 0).all()


def test_greedy_runner_refuses_sampling_params():
    st, runner = make(sampling=False)
    with pytest.raises(ValueError, match=r"samples greedily: build it with "
                                         r"RunnerConfig\(sampling=True\)"):
        runner.add_request("a", [1, 2], sampling=SamplingParams(temperature=1.0))
    assert st.num_active == 0
    slot = runner.add_request("a", [1, 2])
    out = runner.step(SchedulerOutput(np.array([slot]), np.array([2])))
    assert out.logprobs is None and out.sampled_host.wait().tolist() == out.sampled.tolist()


def spec_runner(q, compile=False, device="cpu", proposer=None):
    torch.manual_seed(0)  # float64 on CPU; float32 on CUDA (the Triton kernel's fp32 path)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32)).to(
        device, torch.float64 if device == "cpu" else torch.float32)
    st = RequestState(2, 96, 8, device)
    model.allocate_caches(2 * st.max_num_blocks_per_req, 8)
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(
        capture_sizes=(1, 2), length_boundaries=(32, 64), mixed_token_sizes=(16,),
        decode_query_len=q), compile=compile), proposer=proposer)
    runner.capture(progress=False)
    return st, runner


def plain_greedy(prompt, n, device="cpu"):
    st, runner = spec_runner(1, device=device)
    a = runner.add_request("a", prompt)
    out = runner.step(SchedulerOutput(np.array([a]), np.array([len(prompt)])))
    seq = [int(out.sampled[0])]
    while len(seq) < n:
        out = runner.step(SchedulerOutput(np.array([a]), np.array([1])))
        seq.append(int(out.sampled[0]))
    return seq


@pytest.mark.parametrize(("drafts_from", "compile", "device"),
                         [("target", False, "cpu"), ("noise", False, "cpu"),
                          ("noise", True, "cpu"),
                          ("target", CompileConfig(enabled=True, regions="blocks"), "cpu"),
                          pytest.param("target", False, "cuda", marks=pytest.mark.cuda),
                          pytest.param("noise", True, "cuda", marks=pytest.mark.cuda)])
def test_spec_decode_through_the_runner_matches_plain_decoding(drafts_from, compile, device):
    """Verification runs inside the graph (compiled with the forward when compile=True, or
    around the compiled layers with regions "blocks")."""
    prompt, k, n = [5, 3, 9, 1, 7], 3, 24
    want = plain_greedy(prompt, n + k + 1, device)
    st, runner = spec_runner(k + 1, compile, device)
    a = runner.add_request("a", prompt)
    out = runner.step(SchedulerOutput(np.array([a]), np.array([len(prompt)])))
    got = [int(out.sampled[0])]
    rng = np.random.default_rng(0)
    pending, accepted_total = [], 0
    while len(got) < n:
        drafts = (want[len(got): len(got) + k] if drafts_from == "target"
                  else rng.integers(0, 64, k).tolist())
        sched = SchedulerOutput(np.array([a]), np.array([k + 1]), np.array([k]))
        with no_host_sync():
            out = runner.step(sched, draft_token_ids=drafts)
        assert out.replayed and out.key.query_len == k + 1
        rejected = int(out.rejected_host.wait()[0])
        accepted_total += k - rejected
        got += drafts[: k - rejected] + [int(out.sampled_host.wait()[0])]
        pending.append(out)
        if len(pending) > 1:  # feedback one step late
            assert runner.apply_feedback(pending.pop(0)).applied.all()
        assert st.num_computed_tokens_np[a] >= int(st.num_computed_tokens[a])  # an upper bound
    assert got[:n] == want[:n]
    runner.apply_feedback(pending.pop())
    assert st.num_computed_tokens_np[a] == int(st.num_computed_tokens[a])  # exact again
    steps = (n - 1 + k) // (k + 1)
    if drafts_from == "target":
        assert accepted_total == k * steps  # every draft accepted
    else:
        assert accepted_total < k * steps


def test_drafts_validated_and_stale_feedback_refused():
    st, runner = spec_runner(3)
    a = runner.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="drafts before their prompt is computed"):
        runner.step(SchedulerOutput(np.array([a]), np.array([3]), np.array([2])),
                    draft_token_ids=[4, 5])
    runner.step(SchedulerOutput(np.array([a]), np.array([3])))
    with pytest.raises(ValueError, match=r"draft_token_ids\[1\] = 64, expected in \[0, 63\]"):
        runner.step(SchedulerOutput(np.array([a]), np.array([3]), np.array([2])),
                    draft_token_ids=[4, 64])
    with pytest.raises(ValueError, match="needs draft_token_ids"):
        runner.step(SchedulerOutput(np.array([a]), np.array([3]), np.array([2])))
    assert st.num_computed_tokens_np[a] == 3 == int(st.num_computed_tokens[a])
    out = runner.step(SchedulerOutput(np.array([a]), np.array([3]), np.array([2])),
                      draft_token_ids=[4, 5])
    st.remove_request("a")
    runner.add_request("b", [9, 9])  # takes the slot before a's feedback arrives
    result = runner.apply_feedback(out)
    assert result.stale.tolist() == [True] and st.num_computed_tokens_np[a] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("overlap_copies", [True, False])
def test_token_futures_on_cuda_read_late_and_refuse_a_reused_slot(overlap_copies):
    from graphattn.transfer import OutputRing

    st, runner = make(device="cuda", overlap_copies=overlap_copies)
    runner.capture(progress=False)
    a = runner.add_request("a", [1, 2, 3])
    outs = [runner.step(SchedulerOutput(np.array([a]), np.array([3])))]
    for _ in range(OutputRing.DEPTH + 1):
        with no_host_sync():
            outs.append(runner.step(SchedulerOutput(np.array([a]), np.array([1]))))
    assert outs[-1].sampled_host.wait().tolist() == outs[-1].sampled.tolist()
    with pytest.raises(RuntimeError, match="overwritten: read a TokenFuture within"):
        outs[0].sampled_host.wait()


@pytest.mark.cuda
@pytest.mark.parametrize("side_stream", [True, False])
def test_output_ring_sends_each_step_its_own_tokens_behind_a_busy_stream(side_stream):
    from graphattn.transfer import OutputRing

    ring = OutputRing(6, torch.device("cuda"),
                       stream=torch.cuda.Stream() if side_stream else None)
    src = torch.zeros(6, dtype=torch.int32, device="cuda")
    futures = []
    with no_host_sync():
        for k in range(OutputRing.DEPTH - 1):
            torch.cuda._sleep(200_000)  # the host copy waits on the current stream's work
            src.copy_(torch.arange(6, device="cuda") * (k + 1))
            futures.append(ring.push(src[: 3 + k % 3]))
    for k, f in enumerate(futures):
        assert f.wait().tolist() == [i * (k + 1) for i in range(3 + k % 3)]


@pytest.mark.cuda
def test_staging_ring_reuses_pinned_buffers_on_cuda():
    st, runner = make(device="cuda")
    runner.capture(progress=False)
    a = runner.add_request("a", [1, 2, 3])
    runner.step(SchedulerOutput(np.array([a]), np.array([3])))
    for _ in range(50):
        runner.step(SchedulerOutput(np.array([a]), np.array([1])))
    torch.cuda.synchronize()
    assert runner._staging.num_allocated <= 10  # not one pinned allocation per step


@pytest.mark.parametrize(("compile", "device"), [
    (False, "cpu"), pytest.param(True, "cuda", marks=pytest.mark.cuda)])
def test_ngram_proposer_inside_the_step_matches_plain_decoding(compile, device):
    """Drafts proposed on the device inside the step (no draft ids from the host): the
    emitted tokens are plain decoding's, some drafts are accepted (greedy decoding of a
    random model cycles), and the host learns every token from `emitted_host`."""
    from graphattn.proposer import NgramProposer

    prompt, k, n = [5, 3, 9, 1, 7], 3, 40
    want = plain_greedy(prompt, n + k + 1, device)
    st, runner = spec_runner(k + 1, compile, device, NgramProposer(n=2, window=32))
    a = runner.add_request("a", prompt)
    out = runner.step(SchedulerOutput(np.array([a]), np.array([len(prompt)])))
    got = [int(out.sampled[0])]
    accepted = 0
    while len(got) < n:
        with no_host_sync():
            out = runner.step(SchedulerOutput(np.array([a]), np.array([k + 1]), np.array([k])))
        assert out.replayed
        row = out.emitted_host.wait()[0]
        emitted = row[row >= 0].tolist()
        assert emitted[-1] == int(out.sampled_host.wait()[0])
        accepted += len(emitted) - 1
        got += emitted
        runner.apply_feedback(out)
    assert got[:n] == want[:n]
    assert accepted > 0


@pytest.mark.cuda
def test_steps_on_a_user_stream_replay_there_and_leave_it_current():
    """The runner looks the current stream up once per step (graphattn.transfer.CurrentStream):
    a step under ``torch.cuda.stream(s)`` replays on s, returns with s current and sends
    the same tokens as steps on the default stream."""
    params = [SamplingParams(), SamplingParams(temperature=1.2, top_k=10, seed=3)]
    st, runner = make(device="cuda")
    runner.capture(progress=False)
    expected, _ = generate(runner, st, params, 6)
    st2, other = make(device="cuda")
    other.capture(progress=False)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(500_000)  # the user's stream is busy: its work orders the step's
        got, _ = generate(other, st2, params, 6)
        assert torch.cuda.current_stream() == s
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    np.testing.assert_array_equal(got, expected)
