"""Piecewise mode: the forward compiled once and split at the attention ops; pieces captured
per padded token count (CUDA) or run as FX submodules (CPU); graph modes and dispatch order."""

import numpy as np
import pytest
import torch

from graphattn import GraphRunner, RunnerConfig
from graphattn.buckets import BucketPolicy, LengthBuckets
from graphattn.capture.dispatcher import GraphDispatcher
from graphattn.keys import CUDAGraphMode, GraphKey
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import no_host_sync


def make(mode, device="cpu", dtype=torch.float64, layers=3, **policy):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=layers))
    model = model.to(device, dtype)
    st = RequestState(4, 96, 8, device)
    model.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    pol = BucketPolicy(**{"capture_sizes": (2, 4), "length_boundaries": (32, 64),
                          "piecewise_token_sizes": (16, 32, 64), **policy})
    return model, st, GraphRunner(model, st, RunnerConfig(policy=pol, cudagraph_mode=mode))


def run(model, st, runner, steps, tol, device="cpu"):
    rng = np.random.default_rng(0)
    seqs, modes = {}, []
    for i in range(3):
        p = rng.integers(0, 64, int(rng.integers(10, 40))).tolist()
        seqs[runner.add_request(f"r{i}", p)] = p
    slots = np.array(sorted(seqs), np.int32)
    for _ in range(steps):
        left = st.num_prompt_tokens_np[slots] - st.num_computed_tokens_np[slots]
        sched = SchedulerOutput(slots, np.where(left > 0, np.minimum(left, 9), 1))
        with no_host_sync():
            out = runner.step(sched)
        modes.append(out.mode)
        for j, s in enumerate(slots):
            n = int(st.num_computed_tokens_np[s])
            if n >= st.num_prompt_tokens_np[s]:
                ref = model.reference_logits(torch.tensor(seqs[s][:n], device=device))[-1]
                torch.testing.assert_close(out.logits[j].double(), ref.double(), rtol=tol,
                                           atol=tol)
                seqs[s].append(int(out.sampled[j]))
    return modes


def test_piecewise_steps_match_the_dense_reference_without_recompiles():
    model, st, runner = make(CUDAGraphMode.PIECEWISE)
    report = runner.capture(progress=False)
    assert report.num_graphs == 0 and report.num_piecewise == 3  # no full graphs in this mode
    pc = runner.piecewise
    assert (pc.num_pieces, pc.num_attention_pieces) == (3 + 1, 3)  # attention ops + 1
    assert pc.num_compiles == 1  # one dynamic-shape compile serves every token count
    modes = run(model, st, runner, 12, 1e-9)
    assert set(modes) == {CUDAGraphMode.PIECEWISE}
    assert pc.num_compiles == 1


def test_full_and_piecewise_takes_full_keys_first():
    model, st, runner = make(CUDAGraphMode.FULL_AND_PIECEWISE, mixed_token_sizes=(16,))
    runner.capture(progress=False)
    modes = run(model, st, runner, 12, 1e-9)
    # prefill chunks of 3 x 9 = 27 tokens: no full key (mixed 16) -> piecewise 32; then a
    # uniform decode of 3 rows -> the full key of 4 rows
    assert modes[0] == CUDAGraphMode.PIECEWISE and modes[-1] == CUDAGraphMode.FULL
    assert runner.piecewise.num_compiles == 1


@pytest.mark.parametrize("mode, uniform_key, mixed_key", [
    ("full_and_piecewise", GraphKey(4, 4, 32, True), GraphKey(16, 16, 32, False)),
    ("full", GraphKey(4, 4, 32, True), GraphKey(16, 16, 32, False)),
    ("full_decode_only", GraphKey(4, 4, 32, True), None),
    ("piecewise", GraphKey(4, 4, 96, False), GraphKey(16, 16, 96, False)),
    ("none", None, None),
])
def test_dispatch_order_per_mode(mode, uniform_key, mixed_key):
    d = GraphDispatcher((2, 4), LengthBuckets(96, (32, 64)), 1, (16,), mode=mode,
                        piecewise_token_sizes=(4, 16, 64))
    assert d.dispatch(3, 3, 20, True) == uniform_key
    assert d.dispatch(3, 12, 20, False) == mixed_key
    big = d.dispatch(3, 40, 20, False)  # beyond the mixed sizes: piecewise when it exists
    assert big == (GraphKey(64, 64, 96, False) if "piecewise" in mode else None)
    with pytest.raises(ValueError, match="mode = 'fast', expected one of"):
        GraphDispatcher((2,), LengthBuckets(96), mode="fast")


@pytest.mark.cuda
def test_piecewise_replay_equals_eager_on_cuda_with_no_host_sync():
    model, st, runner = make(CUDAGraphMode.PIECEWISE, device="cuda", dtype=torch.float32)
    runner.capture(progress=False)
    assert runner.piecewise.num_captured == 3 * 4  # 4 pieces x 3 token counts
    modes = run(model, st, runner, 12, 1e-3, device="cuda")  # fp32, inductor's own sum order
    assert set(modes) == {CUDAGraphMode.PIECEWISE}


def test_pieces_compile_with_inductor_and_match_eager():
    """inner="inductor" (the CUDA default): each piece compiled on the fake inputs it sees,
    one dynamic-shape compile serving every token count."""
    from graphattn.backends.paged import PagedAttentionBuilder
    from graphattn.batch import prepare_inputs
    from graphattn.capture.piecewise import PiecewiseCompiler
    from graphattn.metadata import build_common_metadata

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=2))
    st = RequestState(4, 64, 8)
    model.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    for i in range(3):
        st.add_request(f"r{i}", 10, np.arange(i * 8, i * 8 + 8))
    pc = PiecewiseCompiler(model, "cpu", inner="inductor")
    sched = SchedulerOutput(np.arange(3), np.array([4, 2, 3]))
    for t in (32, 16):
        batch = prepare_inputs(st, sched, t, t)
        meta = PagedAttentionBuilder(8).build(build_common_metadata(batch),
                                              GraphKey(t, t, 64, False))
        inputs = {"input_ids": torch.randint(0, 64, (t,)), "positions": batch.positions}
        saved = [tuple(c.clone() for c in pair) for pair in model.caches]
        with torch.inference_mode():
            with pc.at_tokens(t):
                out = pc(inputs, meta)
            for pair, old in zip(model.caches, saved, strict=True):
                for c, o in zip(pair, old, strict=True):
                    c.copy_(o)
            ref = model(inputs, meta)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (pc.num_compiles, pc.num_pieces) == (1, 3)
    with pytest.raises(ValueError, match="inner = 'fast'"):
        PiecewiseCompiler(model, "cpu", inner="fast")
