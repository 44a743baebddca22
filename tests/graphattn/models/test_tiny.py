"""TinyDecoder's caches: the model's dtype or fp8 (an fp8 cache decodes through the same
graphs with the logits close to the model-dtype cache's), refused kinds named."""

import numpy as np
import pytest
import torch

from graphattn import BucketPolicy, GraphRunner, RequestState, RunnerConfig, SchedulerOutput
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.sync import no_host_sync


def first_logits(kv_cache_dtype, device="cpu", kv_scales=None, shrink=1.0):
    """Logits of 4 decode steps after a 19-token prefill (`shrink` scales the value
    projections: small values, deep in fp8's subnormals at scale 1)."""
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=128, hidden_size=64)).to(device)
    with torch.no_grad():
        for layer in model.layers:
            layer.qkv.weight[-model.cfg.num_kv_heads * model.cfg.head_dim:] *= shrink
    st = RequestState(2, 64, 8, device)
    model.allocate_caches(st.num_kv_blocks, 8, kv_cache_dtype,
                          None if kv_scales == "measure" else kv_scales)
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(capture_sizes=(1, 2))))
    runner.capture(progress=False)
    a = runner.add_request("a", list(range(1, 20)))
    runner.step(SchedulerOutput(np.array([a]), np.array([19])))
    logits = []
    for _ in range(4):
        with no_host_sync():
            out = runner.step(SchedulerOutput(np.array([a]), np.array([1])))
        logits.append(out.logits[0].float().cpu())
        assert out.replayed
    if kv_scales == "measure":
        return model.kv_scales()
    return torch.stack(logits), model.caches[0][0].dtype


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp8_cache_decodes_through_the_graphs_close_to_the_model_dtype(device):
    want, dtype = first_logits(None, device)
    got, fp8 = first_logits("fp8_e4m3", device)
    assert fp8 == torch.float8_e4m3fn and dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)


def test_kv_cache_dtype_is_validated():
    model = TinyDecoder(TinyConfig(vocab_size=128, hidden_size=64))
    with pytest.raises(ValueError, match="kv_cache_dtype = 'int8', expected None, 'fp8_e4m3'"):
        model.allocate_caches(4, 8, "int8")


def test_calibrated_scales_keep_small_values_out_of_the_subnormals():
    """kv_scales() of a model-dtype run: each layer's max |K|, |V| / 448; an fp8 cache with
    them tracks the model-dtype logits far closer than scales of 1 when the values are
    small (1e-3 of the usual: below fp8's normal range)."""
    want, _ = first_logits(None, shrink=1e-3)
    scales = first_logits(None, kv_scales="measure", shrink=1e-3)
    assert len(scales) == 2 and all(0 < v < 1e-3 < k for k, v in scales)
    plain, _ = first_logits("fp8_e4m3", shrink=1e-3)
    fitted, _ = first_logits("fp8_e4m3", kv_scales=scales, shrink=1e-3)
    err_plain, err_fitted = (float((x - want).abs().max()) for x in (plain, fitted))
    assert err_fitted < 0.2 * err_plain, (err_fitted, err_plain)


def test_kv_scales_are_validated():
    from graphattn.backends.flex import FlexAttentionImpl

    model = TinyDecoder(TinyConfig(vocab_size=128, hidden_size=64))
    with pytest.raises(ValueError, match="kv_scales are an fp8 cache's"):
        model.allocate_caches(4, 8, None, (0.5, 0.5))
    for bad in ((0.5, -1.0), [(1.0, 1.0)] * 3, "x"):
        with pytest.raises(ValueError, match="expected a positive .k_scale, v_scale. pair or 2"):
            model.allocate_caches(4, 8, "fp8_e4m3", bad)
    with pytest.raises(ValueError, match="kv_scales\\(\\) reads the caches"):
        TinyDecoder(TinyConfig(vocab_size=128, hidden_size=64)).kv_scales()
    model.impl = FlexAttentionImpl.__new__(FlexAttentionImpl)
    with pytest.raises(ValueError, match="FlexAttentionImpl has no fp8 scales"):
        model.allocate_caches(4, 8, "fp8_e4m3", (0.5, 0.5))


@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "compiled"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_small_m_layers_decode_as_the_reference(device, compile):
    """`TinyDecoder.small_m`: decode batches of up to 16 tokens run each layer as the fused
    GEMV ops (the Triton kernel on CUDA, plain torch on CPU), prefills of more tokens the
    usual layers; two requests' logits match the dense float32 reference at every step,
    under no_host_sync(), replayed from graphs (eager or compiled)."""
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=128, hidden_size=64, num_layers=2)).to(device)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    model.small_m = True
    st = RequestState(2, 64, 8, device)
    model.allocate_caches(st.num_kv_blocks, 8)
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(capture_sizes=(1, 2)),
                                                 compile=compile))
    runner.capture(progress=False)
    seqs = {runner.add_request("a", list(range(1, 20))): list(range(1, 20)),
            runner.add_request("b", [7, 3, 5]): [7, 3, 5]}
    slots = np.array(sorted(seqs))
    sched = SchedulerOutput(slots, np.array([len(seqs[s]) for s in slots]))
    tol = 1e-4 if device == "cpu" else 2e-3
    for step in range(5):
        with no_host_sync():
            out = runner.step(sched)
        assert out.replayed == (step > 0)  # the 22-token prefill runs eagerly
        for j, s in enumerate(slots):
            ref = model.reference_logits(torch.tensor(seqs[s], device=device))[-1]
            torch.testing.assert_close(out.logits[j].float(), ref, rtol=tol, atol=tol)
            seqs[s].append(int(out.sampled[j]))
        sched = SchedulerOutput(slots, np.ones(2, np.int32))
