import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from graphattn.backends.flex import (
    FlexAttentionBuilder,
    FlexAttentionImpl,
    _mask_mod,
    block_mask_tensors,
)
from graphattn.backends.kernels import allocate_kv_cache
from graphattn.backends.paged import PagedAttentionBuilder, PagedAttentionImpl
from graphattn.buckets import LengthBuckets
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


@pytest.mark.parametrize("seed, block", [(0, 16), (1, 32), (2, 8)])
def test_block_mask_tensors_equal_create_block_mask(seed, block):
    """Our fixed-shape block tensors are create_block_mask's for the same mask_mod."""
    g = torch.Generator().manual_seed(seed)
    rows, kv_per_row = 5, 2 * block + 8
    t = 3 * block + 5
    q_len, kv_len = 4 * block, -(-rows * kv_per_row // block) * block
    req = torch.randint(0, rows, (q_len,), generator=g).sort().values
    pos = torch.randint(0, kv_per_row + 4, (q_len,), generator=g)  # some past the row: clamped
    valid = torch.arange(q_len) < t
    req[t:], pos[t:] = -1, 0
    pos[:block] = kv_per_row - 1  # a whole tile of full rows: full blocks appear
    req[:block] = 0
    with no_host_sync():
        got = block_mask_tensors(req, pos, valid, kv_per_row, kv_len, block)
    want = create_block_mask(_mask_mod(req, pos.clamp(max=kv_per_row - 1), valid, kv_per_row),
                             None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=block)
    assert int(got[2].sum()) > 0 and int(got[0].sum()) > 0
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    for name, ours in zip(names, got, strict=True):
        theirs = getattr(want, name)
        assert ours.dtype == theirs.dtype == torch.int32 and ours.shape == theirs.shape, name
    torch.testing.assert_close(got[0], want.kv_num_blocks)
    torch.testing.assert_close(got[2], want.full_kv_num_blocks)
    for num, ours, theirs in ((got[0], got[1], want.kv_indices),
                              (got[2], got[3], want.full_kv_indices)):
        for i, n in enumerate(num.flatten().tolist()):  # the listed blocks; the tail is unused
            assert ours[0, 0, i, :n].tolist() == theirs[0, 0, i, :n].tolist()
    with pytest.raises(ValueError, match="multiples of"):
        block_mask_tensors(req, pos, valid, kv_per_row, kv_len + 1, block)


def test_block_mask_tensors_on_meta():
    req = torch.zeros(32, dtype=torch.long, device="meta")
    with no_host_sync():
        num, idx, fnum, fidx = block_mask_tensors(req, req, req > 0, 16, 64, 16)
    assert num.shape == (1, 1, 2) and idx.shape == (1, 1, 2, 4) and fidx.device.type == "meta"
