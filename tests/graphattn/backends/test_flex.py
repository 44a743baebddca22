import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from bench.workload import WorkloadConfig
from graphattn.backends.flex import (
    FlexAttentionBuilder,
    FlexAttentionImpl,
    _mask_mod,
    _row_mask_mod,
    block_mask_tensors,
    row_block_mask_tensors,
)
from graphattn.backends.paged import PagedAttentionBuilder, PagedAttentionImpl
from graphattn.backends.reference import allocate_kv_cache
from graphattn.buckets import LengthBuckets
from graphattn.keys import GraphKey
from graphattn.sync import no_host_sync
from tests.graphattn.backends.harness import Scenario

H, HKV, D, BS = 4, 2, 8, 8


DECODE = {"prompt_len": (1, 1), "max_new_tokens": (30, 90), "arrival_prob": 1.0}


@pytest.mark.parametrize("layout", ["auto", "packed"])
@pytest.mark.parametrize("case, pad, per_row", [  # per_row: layouts "auto" visits
    ({"token_budget": 40}, (0, 0), {False, True}),
    ({"token_budget": 40, "num_spec_tokens": 2, "feedback_delay": 2}, (2, 3), {False, True}),
    (DECODE, (0, 0), {True}),
    ({**DECODE, "num_spec_tokens": 2}, (0, 0), {True})])
def test_matches_paged_and_dense(case, pad, per_row, layout):
    """Same inputs through flex and through paged (itself checked against float64); the
    per-row layout on batches whose rows fit it, the packed one otherwise."""
    cfg = WorkloadConfig(**case)
    sc = Scenario(cfg, seed=21 + cfg.num_spec_tokens, block_size=BS)
    lb = LengthBuckets(sc.state.max_model_len)
    flex_caches = [allocate_kv_cache(sc.num_blocks, BS, HKV, D, torch.float64, "cpu")
                   for _ in range(2)]
    paged_caches = [c.clone() for c in flex_caches]
    fb = FlexAttentionBuilder(BS, lb, mask_block_size=16, layout=layout)
    fi = FlexAttentionImpl(H, D, HKV)
    pb = PagedAttentionBuilder(BS, cfg.num_spec_tokens + 1)
    pi = PagedAttentionImpl(H, D, HKV)
    lens, layouts = set(), set()
    for _ in range(20):
        s, batch, common = sc.next_batch(*pad)
        t = batch.num_tokens_padded
        q, k, v = sc.rand(t, H, D), sc.rand(t, HKV, D), sc.rand(t, HKV, D)
        with no_host_sync(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            meta = fb.build(common)
            out = fi.forward(q, k, v, flex_caches, meta)
        lens.add(meta.max_len)
        layouts.add(meta.row_query_len > 0)
        assert meta.max_len in lb.boundaries and meta.max_len >= common.max_seq_len
        ref = pi.forward(q, k, v, paged_caches, pb.build(common))
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        assert not out[batch.slot_mapping[:t] < 0].any()  # padded tokens give 0
        sc.finish(s)
    assert len(lens) >= 2  # several buckets visited
    assert layouts == ({False} if layout == "packed" else per_row)


@pytest.mark.parametrize("spec", [0, 2])
def test_per_row_layout_of_uniform_keys_with_padded_rows(spec):
    """A uniform key's batch, padded by a row of no tokens and its q tokens: per-row layout
    (padded row and tokens masked, 0 out), equal to paged."""
    q_len = spec + 1
    sc = Scenario(WorkloadConfig(**DECODE, num_spec_tokens=spec), seed=5, block_size=BS)
    lb = LengthBuckets(sc.state.max_model_len)
    caches = [allocate_kv_cache(sc.num_blocks, BS, HKV, D, torch.float64, "cpu")
              for _ in range(2)]
    paged_caches = [c.clone() for c in caches]
    fb, fi = FlexAttentionBuilder(BS, lb, mask_block_size=16), FlexAttentionImpl(H, D, HKV)
    pb, pi = PagedAttentionBuilder(BS, q_len), PagedAttentionImpl(H, D, HKV)
    used = 0
    for _ in range(12):
        s, batch, common = sc.next_batch(1, q_len)
        uniform = bool((common.query_lens_cpu[: s.num_reqs] == q_len).all())
        key = GraphKey(common.num_reqs, common.num_tokens_padded,
                       lb.bucket(common.max_seq_len), uniform)
        t = batch.num_tokens_padded
        q, k, v = sc.rand(t, H, D), sc.rand(t, HKV, D), sc.rand(t, HKV, D)
        with no_host_sync(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            meta = fb.build(common, key)
            out = fi.forward(q, k, v, caches, meta)
        used += meta.row_query_len == q_len
        assert meta.row_query_len == (q_len if uniform else 0)
        torch.testing.assert_close(out, pi.forward(q, k, v, paged_caches, pb.build(common, key)),
                                   rtol=1e-6, atol=1e-6)
        assert not out[batch.slot_mapping[:t] < 0].any()
        sc.finish(s)
    assert used >= 6


@pytest.mark.parametrize("layout", ["auto", "packed"])
def test_meta_builder(layout):
    sc = Scenario(WorkloadConfig(), seed=2, block_size=BS, device="meta")
    s, batch, common = sc.next_batch(1, 1)
    builder = FlexAttentionBuilder(BS, LengthBuckets(128), layout=layout)
    with no_host_sync():
        meta = builder.build(common)
    assert meta.max_len == LengthBuckets(128).bucket(common.max_seq_len)
    assert meta.kv_len % 128 == 0 and meta.kv_indices.device.type == "meta"
    q = builder.row_query_len(common, None)
    assert meta.row_query_len == q and (q > 0) == (layout == "auto")
    if q:
        rows = common.num_reqs
        assert meta.q_len == q and meta.mask_pos.shape == (rows, q)
        assert meta.kv_num_blocks.shape == (rows, 1, 1)
        assert meta.token_cells.shape == (common.num_tokens_padded,)
    else:
        assert meta.q_len % 128 == 0 and meta.mask_req.shape == (meta.q_len,)


def test_builder_refuses_bad_arguments():
    with pytest.raises(ValueError, match="block_size = 0"):
        FlexAttentionBuilder(0, LengthBuckets(8))
    with pytest.raises(ValueError, match=r"layout = 'rows', expected one of \('auto', 'packed'\)"):
        FlexAttentionBuilder(8, LengthBuckets(8), layout="rows")


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


def _block_sets(num, idx):
    """{(batch, query block, kv block)} listed by block tensors."""
    return {(b, i, k) for b in range(num.shape[0]) for i, n in enumerate(num[b, 0].tolist())
            for k in idx[b, 0, i, :n].tolist()}


@pytest.mark.parametrize("q, block", [(16, 16), (24, 8), (1, 16), (3, 16), (20, 8)])
def test_row_block_mask_tensors_match_create_block_mask(q, block):
    """The per-row layout's block tensors list the blocks create_block_mask lists for its
    mask_mod: the same ones when q fills its query blocks; otherwise the same blocks
    touched, and more of them full (a query slot flex does not run breaks no full block)."""
    g = torch.Generator().manual_seed(q)
    rows, kv_len = 6, 5 * block
    pos = torch.randint(0, kv_len + 3, (rows, q), generator=g)  # some past the row: clamped
    pos[0] = kv_len - 1  # a whole row sees everything: full blocks appear
    valid = torch.rand(rows, q, generator=g) < 0.8
    valid[0] = True
    with no_host_sync():
        got = row_block_mask_tensors(pos, valid, kv_len, block)
    want = create_block_mask(_row_mask_mod(pos.clamp(max=kv_len - 1), valid), rows, None, q,
                             kv_len, device="cpu", BLOCK_SIZE=block)
    assert int(got[2].sum()) > 0
    for ours, theirs in zip(got, (want.kv_num_blocks, want.kv_indices, want.full_kv_num_blocks,
                                  want.full_kv_indices), strict=True):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == torch.int32
    partial, full = _block_sets(*got[:2]), _block_sets(*got[2:])
    their_partial = _block_sets(want.kv_num_blocks, want.kv_indices)
    their_full = _block_sets(want.full_kv_num_blocks, want.full_kv_indices)
    assert partial | full == their_partial | their_full and not partial & full
    if q % block == 0:
        assert (partial, full) == (their_partial, their_full)
    else:
        assert full >= their_full
    with pytest.raises(ValueError, match=f"kv_len {kv_len + 1} must be a multiple of"):
        row_block_mask_tensors(pos, valid, kv_len + 1, block)


def test_row_block_mask_tensors_on_meta():
    pos = torch.zeros(4, 1, dtype=torch.long, device="meta")
    with no_host_sync():
        num, idx, fnum, fidx = row_block_mask_tensors(pos, pos > 0, 64, 16)
    assert num.shape == (4, 1, 1) and idx.shape == (4, 1, 1, 4) and fidx.device.type == "meta"
