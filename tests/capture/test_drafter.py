"""DraftModelProposer: a draft model inside the step, on its own paged cache and CPU bounds.

A draft with the target's weights drafts exactly what the target would sample (100%
acceptance); any draft leaves the tokens those of plain greedy decoding. Every step runs
under no_host_sync()."""

import copy

import numpy as np
import pytest
import torch

from graphattn import (
    CUDAGraphMode,
    DraftModelProposer,
    GraphRunner,
    NgramProposer,
    RunnerConfig,
    SamplingParams,
    SchedulerOutput,
)
from graphattn.buckets import BucketPolicy
from graphattn.models.eagle import EagleHead
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState
from graphattn.sync import no_host_sync

K = 3
PROMPTS = [[5, 3, 9, 1, 7], [2, 8, 8, 4, 6, 1, 9, 3, 3, 7, 2, 11, 5]]


def dtype_of(device):  # float64 on CPU; float32 on CUDA (the Triton kernel's fp32 path)
    return torch.float64 if device == "cpu" else torch.float32


def target_model(device, layers=2):
    torch.manual_seed(0)
    return TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=layers)).to(
        device, dtype_of(device))


def small_draft(target, device):
    torch.manual_seed(1)
    return TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=1)).to(
        device, dtype_of(device))


def make(draft=None, q=K + 1, device="cpu", mode=CUDAGraphMode.FULL_AND_PIECEWISE,
         compile=False, sampling=False, layers=2):
    """Target, state and runner; `draft`: "target" (a copy of the target), or a function of
    (target, device) returning the draft model."""
    model = target_model(device, layers)
    st = RequestState(2, 96, 8, device)
    blocks = 2 * st.max_num_blocks_per_req
    model.allocate_caches(blocks, 8)
    proposer = None
    if draft is not None:
        drafter = copy.deepcopy(model) if draft == "target" else draft(model, device)
        drafter.allocate_caches(blocks, 8)
        proposer = DraftModelProposer(drafter)
    policy = BucketPolicy(capture_sizes=(1, 2), length_boundaries=(32, 64),
                          mixed_token_sizes=(16,), decode_query_len=q,
                          piecewise_token_sizes=(8, 16) if mode.has_piecewise else ())
    runner = GraphRunner(model, st, RunnerConfig(policy=policy, cudagraph_mode=mode,
                                                 compile=compile, sampling=sampling),
                         proposer=proposer)
    if mode != CUDAGraphMode.NONE:
        runner.capture(progress=False)
    return st, runner


def serve(runner, prompts, n, chunk=4, between=None, sampling=None):
    """Prefill `chunk` tokens a step, then verify K drafts a step, until each request has
    `n` tokens; returns (tokens per request, accepted, drafted)."""
    st = runner.state
    slots = np.array([runner.add_request(f"r{i}", p, sampling=sampling)
                      for i, p in enumerate(prompts)], np.int32)
    got, accepted, drafted = [[] for _ in prompts], 0, 0
    while min(len(g) for g in got) < n:
        left = st.num_prompt_tokens_np[slots] - st.num_computed_tokens_np[slots]
        decode = left <= 0
        sched = SchedulerOutput(slots, np.where(decode, K + 1, np.minimum(left, chunk)),
                                np.where(decode, K, 0))
        with no_host_sync():
            out = runner.step(sched)
        emitted = out.emitted_host.wait()
        for j in np.flatnonzero(decode | (left <= chunk)):
            row = emitted[j][emitted[j] >= 0].tolist()
            got[j] += row
            if decode[j]:
                accepted, drafted = accepted + len(row) - 1, drafted + K
        runner.apply_feedback(out)
        if between is not None:
            between(runner)
    return [g[:n] for g in got], accepted, drafted


def plain_greedy(prompts, n, device="cpu", layers=2):
    st, runner = make(q=1, device=device, layers=layers)
    slots = np.array([runner.add_request(f"r{i}", p) for i, p in enumerate(prompts)], np.int32)
    got = [[] for _ in prompts]
    for j, (s, p) in enumerate(zip(slots, prompts, strict=True)):
        got[j].append(int(runner.step(SchedulerOutput(np.array([s]), np.array([len(p)])))
                          .sampled[0]))
    while min(len(g) for g in got) < n:
        out = runner.step(SchedulerOutput(slots, np.ones(len(slots), np.int32)))
        for j in range(len(prompts)):
            got[j].append(int(out.sampled[j]))
    return [g[:n] for g in got]


@pytest.mark.parametrize(("mode", "compile", "device"), [
    (CUDAGraphMode.FULL_AND_PIECEWISE, False, "cpu"),
    (CUDAGraphMode.PIECEWISE, False, "cpu"),
    (CUDAGraphMode.NONE, False, "cpu"),
    (CUDAGraphMode.FULL_AND_PIECEWISE, True, "cpu"),
    pytest.param(CUDAGraphMode.FULL_AND_PIECEWISE, False, "cuda", marks=pytest.mark.cuda),
    pytest.param(CUDAGraphMode.FULL_AND_PIECEWISE, True, "cuda", marks=pytest.mark.cuda)],
    ids=["full", "piecewise", "eager", "compiled", "cuda-full", "cuda-compiled"])
def test_draft_equal_to_target_accepts_every_draft(mode, compile, device):
    """Two requests, chunked prefill beside verify steps (mixed keys), every step replayed
    under no_host_sync(): tokens are plain greedy decoding's, every draft accepted."""
    n = 30
    want = plain_greedy(PROMPTS, n, device)
    st, runner = make("target", device=device, mode=mode, compile=compile)
    got, accepted, drafted = serve(runner, PROMPTS, n)
    assert got == want
    assert accepted == drafted > 0


def test_small_random_draft_keeps_greedy_tokens():
    want = plain_greedy(PROMPTS, 30)
    st, runner = make(small_draft)
    got, accepted, drafted = serve(runner, PROMPTS, 30)
    assert got == want
    assert accepted < drafted


def poison_past_truth(runner):
    """Large finite values in every cache slot at or past each live request's true length
    (the rejected drafts' KV and the drafts' own): read as valid, they would change the
    logits; masked, they change nothing."""
    st = runner.state
    gen = torch.Generator().manual_seed(int(st.num_steps))
    models = (runner.forward, runner.device_step.proposer.model)
    for slot in np.flatnonzero(st.active_np):
        truth = int(st.num_computed_tokens[slot])
        blocks = st.block_table_np[slot, : st.num_blocks_np[slot]]
        for pos in range(truth, blocks.shape[0] * st.block_size):
            b, off = blocks[pos // st.block_size], pos % st.block_size
            for model in models:
                for pair in model.caches:
                    for cache in pair:
                        cache[b, off] = 1e3 * torch.randn(cache[b, off].shape, generator=gen,
                                                          dtype=cache.dtype)


def test_rejected_draft_slots_are_never_read_as_valid():
    want = plain_greedy(PROMPTS, 30)
    st, runner = make("target")
    got, accepted, drafted = serve(runner, PROMPTS, 30, between=poison_past_truth)
    assert got == want and accepted == drafted
    st, runner = make(small_draft)
    got, accepted, drafted = serve(runner, PROMPTS, 30, between=poison_past_truth)
    assert got == want and accepted < drafted


def test_dummy_runs_between_steps_change_nothing():
    """A data-parallel rank's padded replays run the drafter on padded rows only."""
    want = plain_greedy(PROMPTS, 24)
    st, runner = make("target")
    keys = runner.dispatcher.all_keys()

    def dummies(r):
        for key in keys[:3]:
            r.dummy_run(key)

    got, accepted, drafted = serve(runner, PROMPTS, 24, between=dummies)
    assert got == want and accepted == drafted


def test_steps_padded_to_a_larger_agreed_key_keep_every_draft():
    """Data parallel: every step runs padded to the largest key its ranks agreed on (here
    2 rows for 1 live request); the drafter's padded rows draft into the spare row."""
    prompt = PROMPTS[1]
    want = plain_greedy([prompt], 20)[0]
    st, runner = make("target")
    a = runner.add_request("a", prompt)
    keys = runner.dispatcher.all_keys()
    mixed = next(k for k in keys if not k.uniform_decode)
    decode = next(k for k in keys if k.uniform_decode and k.num_reqs_padded == 2)
    out = runner.step(SchedulerOutput(np.array([a]), np.array([len(prompt)])), key=mixed)
    got, accepted, drafted = [int(out.sampled[0])], 0, 0
    while len(got) < 20:
        with no_host_sync():
            out = runner.step(SchedulerOutput(np.array([a]), np.array([K + 1]), np.array([K])),
                              key=decode)
        row = out.emitted_host.wait()[0]
        got += row[row >= 0].tolist()
        accepted, drafted = accepted + int((row >= 0).sum()) - 1, drafted + K
        runner.apply_feedback(out)
    assert got[:20] == want and accepted == drafted and out.replayed


def test_resumed_request_keeps_drafting_from_its_kept_blocks():
    """Preempted after some tokens and resumed with its first 16 tokens kept (prompt +
    generated as the new prompt): the draft cache of those blocks is still right."""
    prompt, n = PROMPTS[1], 30
    want = plain_greedy([prompt], n)[0]
    st, runner = make("target")
    first, accepted, drafted = serve(runner, [prompt], 9)
    blocks = st.block_table_np[0, : st.num_blocks_np[0]].copy()
    st.remove_request("r0")
    resumed = prompt + first[0]
    slot = runner.add_request("r0", resumed, blocks, num_computed_tokens=16)
    assert slot == 0
    rest, acc2, drafted2 = serve_resumed(runner, slot, len(resumed), n - len(first[0]))
    assert first[0] + rest == want
    assert accepted + acc2 == drafted + drafted2


def serve_resumed(runner, slot, prompt_len, n):
    st, got, accepted, drafted = runner.state, [], 0, 0
    slots = np.array([slot], np.int32)
    while len(got) < n:
        left = prompt_len - st.num_computed_tokens_np[slot]
        decode = left <= 0
        with no_host_sync():
            out = runner.step(SchedulerOutput(slots, np.array([K + 1 if decode else left]),
                                              np.array([K if decode else 0])))
        row = out.emitted_host.wait()[0]
        got += row[row >= 0].tolist()
        if decode:
            accepted, drafted = accepted + (row >= 0).sum() - 1, drafted + K
        runner.apply_feedback(out)
    return got[:n], accepted, drafted


def test_sampled_rows_with_an_exact_draft_accept_every_draft():
    """Rejection sampling with the draft's probabilities: with q = p every draft is kept,
    and a seeded request samples the same tokens replayed and eager."""
    params = SamplingParams(temperature=1.0, seed=5)
    runs = []
    for mode in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.NONE):
        st, runner = make("target", mode=mode, sampling=True)
        runs.append(serve(runner, PROMPTS, 24, sampling=params))
    (got, accepted, drafted), (eager, _, _) = runs
    assert accepted == drafted > 0 and got == eager
    assert len(set(got[0])) > 5  # it does sample


def test_refused_when_wrapped():
    with pytest.raises(ValueError, match="decode_query_len > 1"):
        make("target", q=1)
    model = TinyDecoder(TinyConfig(vocab_size=32, hidden_size=32)).double()
    st = RequestState(2, 96, 8, "cpu")
    target = target_model("cpu")
    target.allocate_caches(2 * st.max_num_blocks_per_req, 8)
    model.allocate_caches(2 * st.max_num_blocks_per_req, 8)
    config = RunnerConfig(policy=BucketPolicy(capture_sizes=(1,), decode_query_len=2))
    with pytest.raises(ValueError, match="draft model's vocab_size = 32, expected the "
                                         "target's 64"):
        GraphRunner(target, st, config, proposer=DraftModelProposer(model))
    small = small_draft(target, "cpu")
    small.allocate_caches(4, 8)
    with pytest.raises(ValueError, match=r"caches\[0\]: 5 blocks"):
        GraphRunner(target, st, config, proposer=DraftModelProposer(small))
    with pytest.raises(ValueError, match="allocate_caches"):
        GraphRunner(target, st, config, proposer=DraftModelProposer(small_draft(target, "cpu")))
    head = EagleHead.for_target(target)
    head.allocate_caches(2 * st.max_num_blocks_per_req, 8)
    with pytest.raises(ValueError, match="has no keep_hidden_states"):
        GraphRunner(lambda inputs, meta: None, st, config, proposer=DraftModelProposer(head))


def exact_eagle(target, device):
    """For a 1-layer target: a head that ignores the hidden state (fc = [I | 0]) and runs
    the target's own layer drafts exactly the target's tokens."""
    head = EagleHead.for_target(target)
    h = target.cfg.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], 1))
    head.layer = target.layers[0]
    return head


def hidden_only_eagle(target, device):
    """A head whose output is its hidden input (fc = [0 | I], the layer adding nothing): its
    drafts are the target's own prediction at the position before, i.e. the bonus token."""
    head = EagleHead.for_target(target)
    h = target.cfg.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.zeros(h, h), torch.eye(h)], 1))
        head.layer.o.weight.zero_()
        head.layer.down.weight.zero_()
    return head


def random_eagle(target, device):
    torch.manual_seed(2)
    return EagleHead.for_target(target)


@pytest.mark.parametrize(("mode", "compile", "device"), [
    (CUDAGraphMode.FULL_AND_PIECEWISE, False, "cpu"),
    (CUDAGraphMode.PIECEWISE, False, "cpu"),
    (CUDAGraphMode.FULL_AND_PIECEWISE, True, "cpu"),
    pytest.param(CUDAGraphMode.FULL_AND_PIECEWISE, False, "cuda", marks=pytest.mark.cuda)],
    ids=["full", "piecewise", "compiled", "cuda-full"])
def test_eagle_head_drafts_from_the_targets_hidden_states(mode, compile, device):
    """An exact head accepts every draft; a random one keeps the greedy tokens; a head that
    echoes its hidden input drafts the bonus token k times (the hidden state handed over
    is the one at the row's last verified position)."""
    want = plain_greedy(PROMPTS, 24, device, layers=1)
    st, runner = make(exact_eagle, device=device, mode=mode, compile=compile, layers=1)
    got, accepted, drafted = serve(runner, PROMPTS, 24, between=poison_past_truth)
    assert got == want and accepted == drafted > 0
    st, runner = make(random_eagle, device=device, mode=mode, compile=compile, layers=1)
    got, accepted, drafted = serve(runner, PROMPTS, 24)
    assert got == want and accepted < drafted
    st, runner = make(hidden_only_eagle, device=device, mode=mode, compile=compile, layers=1)
    slots = []

    def check(r):
        rows = np.flatnonzero(st.num_computed_tokens_np[:2] >= st.num_prompt_tokens_np[:2])
        sampled = r.token_ids[rows, st.num_computed_tokens_np[rows]]
        drafts = r.device_step.proposer.drafts[rows]
        assert torch.equal(drafts, sampled[:, None].expand(-1, K))
        slots.extend(rows)

    serve(runner, PROMPTS, 8, between=check)
    assert slots


def test_eagle_head_on_a_wrapped_transformers_model_keeps_its_tokens():
    """HFCausalLM exposes transformers' last hidden states (``keep_hidden_states``): a
    random EAGLE head drafts from them inside the step; tokens stay those of the same model
    verifying n-gram drafts (greedy's)."""
    transformers = pytest.importorskip("transformers")
    from graphattn.models.hf import HFCausalLM

    def runner_of(with_head):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=128)
        hf = HFCausalLM(transformers.LlamaForCausalLM(cfg).double().eval())
        st = RequestState(2, 96, 8, "cpu")
        hf.allocate_caches(2 * st.max_num_blocks_per_req, 8)
        proposer = NgramProposer(n=2, window=32)
        if with_head:
            torch.manual_seed(3)
            head = EagleHead.for_target(hf)
            head.allocate_caches(2 * st.max_num_blocks_per_req, 8)
            proposer = DraftModelProposer(head)
        policy = BucketPolicy(capture_sizes=(1, 2), length_boundaries=(64,),
                              mixed_token_sizes=(16,), decode_query_len=K + 1)
        runner = GraphRunner(hf, st, RunnerConfig(policy=policy), proposer=proposer)
        runner.capture(progress=False)
        return runner

    plain, _, _ = serve(runner_of(False), PROMPTS, 16)
    got, accepted, drafted = serve(runner_of(True), PROMPTS, 16)
    assert got == plain and 0 <= accepted < drafted
