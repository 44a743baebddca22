import warnings

import pytest
import torch

from capture.buckets import LengthBuckets
from graphattn.backends.flex import FlexAttentionBuilder, FlexAttentionImpl
from graphattn.backends.kernels import allocate_kv_cache
from graphattn.backends.paged import PagedAttentionBuilder, PagedAttentionImpl
from graphattn.sync import no_host_sync
from graphattn.workload import WorkloadConfig
from tests.graphattn.backends.harness import Scenario

H, HKV, D, BS = 4, 2, 8, 8


@pytest.mark.parametrize("spec, pad", [(0, (0, 0)), (2, (2, 3))])
def test_matches_paged_and_dense(spec, pad):
    """Same inputs through flex and through paged (itself checked against float64)."""
    cfg = WorkloadConfig(token_budget=40, num_spec_tokens=spec, feedback_delay=2)
    sc = Scenario(cfg, seed=21 + spec, block_size=BS)
    lb = LengthBuckets(sc.state.max_model_len)
    flex_caches = [allocate_kv_cache(sc.num_blocks, BS, HKV, D, torch.float64, "cpu")
                   for _ in range(2)]
    paged_caches = [c.clone() for c in flex_caches]
    fb, fi = FlexAttentionBuilder(BS, lb, mask_block_size=16), FlexAttentionImpl(H, D, HKV)
    pb, pi = PagedAttentionBuilder(BS, spec + 1), PagedAttentionImpl(H, D, HKV)
    lens = set()
    for _ in range(20):
        s, batch, common = sc.next_batch(*pad)
        t = batch.num_tokens_padded
        q, k, v = sc.rand(t, H, D), sc.rand(t, HKV, D), sc.rand(t, HKV, D)
        with no_host_sync(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            meta = fb.build(common)
            out = fi.forward(q, k, v, flex_caches, meta)
        lens.add(meta.max_len)
        assert meta.max_len in lb.boundaries and meta.max_len >= common.max_seq_len
        ref = pi.forward(q, k, v, paged_caches, pb.build(common))
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        sc.finish(s)
    assert len(lens) >= 2  # several buckets visited


def test_meta_builder():
    sc = Scenario(WorkloadConfig(), seed=2, block_size=BS, device="meta")
    s, batch, common = sc.next_batch(1, 1)
    with no_host_sync():
        meta = FlexAttentionBuilder(BS, LengthBuckets(128)).build(common)
    assert meta.max_len == LengthBuckets(128).bucket(common.max_seq_len)
    with pytest.raises(ValueError, match="block_size = 0"):
        FlexAttentionBuilder(0, LengthBuckets(8))
    assert meta.q_len % 128 == 0 and meta.kv_len % 128 == 0
    assert meta.mask_req.shape == (meta.q_len,) and meta.kv_indices.device.type == "meta"


def test_compiled_cuda_needs_128_blocks():
    impl = FlexAttentionImpl(H, D, HKV, compile=True)
    with pytest.raises(ValueError, match="mask_block_size = 32: compiled flex_attention on CUDA"):
        impl._flex(torch.device("cuda"), 32)
