import numpy as np
import pytest
import torch

from bench.workload import WorkloadConfig
from graphattn.backends.reference import allocate_kv_cache
from graphattn.backends.sparse_indexer import (
    PrefillChunk,
    SparseIndexerBuilder,
    SparseIndexerImpl,
    plan_prefill_chunks,
)
from graphattn.keys import GraphKey
from graphattn.sync import no_host_sync
from tests.graphattn.backends.harness import Scenario, dense_attention

H, HKV, D, HI, DI, BS, TOPK = 4, 2, 8, 2, 6, 4, 6


def test_plan_prefill_chunks_hand_computed():
    q = np.array([2, 3, 1, 4])
    bound = np.array([10, 4, 20, 5])
    # costs from row 0: 2*10=20, 5*10=50, 6*20=120 -> budget 60 takes rows 0-1
    chunks = plan_prefill_chunks(q, bound, 60, row_offset=1, tok_offset=3)
    assert chunks == (PrefillChunk(1, 3, 3, 8, 10), PrefillChunk(3, 4, 8, 9, 20),
                      PrefillChunk(4, 5, 9, 13, 5))
    assert plan_prefill_chunks(q, bound, 1)[0] == PrefillChunk(0, 1, 0, 2, 10)  # oversize row
    assert plan_prefill_chunks(q[:0], bound[:0], 10) == ()
    for c in plan_prefill_chunks(q, bound, 60):
        assert (c.tok_end - c.tok_start) * c.max_len <= 60 or c.req_end - c.req_start == 1


def run_sparse(spec, budget, pad, device="cpu", kernel="auto", dtype=torch.float64, tol=1e-6,
               steps=25):
    """Random steps through the indexer and the attention over its selection, each token
    against the float64 dense reference over the positions it should select."""
    cfg = WorkloadConfig(prompt_len=(3, 30), token_budget=30, num_spec_tokens=spec,
                         feedback_delay=2)
    sc = Scenario(cfg, seed=31 + spec, block_size=BS, device=device)
    caches = [allocate_kv_cache(sc.num_blocks, BS, h, d, dtype, device)
              for h, d in ((HKV, D), (HKV, D), (1, DI))]
    builder = SparseIndexerBuilder(BS, budget, spec + 1)
    impl = SparseIndexerImpl(H, D, HKV, TOPK, kernel=kernel)
    max_chunks = 0
    for _ in range(steps):
        s, batch, common = sc.next_batch(*pad)
        t = batch.num_tokens_padded
        q, k, v = (sc.rand(t, h, D).to(device, dtype) for h in (H, HKV, HKV))
        # strictly positive indexer inputs: no relu zeros, so no score ties
        qi, ki, w = (sc.rand(*shape).abs().to(device, dtype) + 0.01
                     for shape in ((t, HI, DI), (t, DI), (t, HI)))
        with no_host_sync():
            meta = builder.build(common)
            out, sel = impl.forward(q, k, v, qi, ki, w, caches, meta)
        max_chunks = max(max_chunks, len(meta.prefill_chunks))
        n = s.total_num_scheduled_tokens
        sc.record(s, batch, torch.cat([k[:n].flatten(1), v[:n].flatten(1), ki[:n]], 1))
        _, slots, pos = sc.token_views(s, batch)
        out, sel, q, qi, w = (x.cpu().double() if x.is_floating_point() else x.cpu()
                              for x in (out, sel, q, qi, w))
        for i in range(n):
            e = sc.logical[int(slots[i])][: pos[i] + 1]
            ks, vs, kis = e[:, : HKV * D], e[:, HKV * D: 2 * HKV * D], e[:, 2 * HKV * D:]
            score = (torch.einsum("hd,ld->hl", qi[i], kis).relu() * w[i][:, None]).sum(0)
            top = score.topk(min(TOPK, pos[i] + 1)).indices
            assert sel[i, : top.numel()].tolist() == top.tolist()
            assert (sel[i, top.numel():] == -1).all()
            ref = dense_attention(q[i], ks[top].view(-1, HKV, D), vs[top].view(-1, HKV, D),
                                  impl.scale)
            torch.testing.assert_close(out[i], ref, rtol=tol, atol=tol)
        assert out[n:].abs().sum().item() == 0.0 and (sel[n:] == -1).all()
        sc.finish(s)
    assert max_chunks >= 2


@pytest.mark.parametrize("spec, budget, pad", [(0, 400, (0, 0)), (2, 150, (2, 3))])
def test_matches_dense_reference(spec, budget, pad):
    run_sparse(spec, budget, pad)


@pytest.mark.cuda
@pytest.mark.parametrize("spec, budget, pad", [(0, 400, (0, 0)), (2, 150, (2, 3))])
def test_triton_matches_dense_reference(spec, budget, pad):
    """The selection read by the Triton kernel through one-slot pages (float32)."""
    run_sparse(spec, budget, pad, "cuda", "triton", torch.float32, tol=2e-3)


def test_errors_and_meta():
    sc = Scenario(WorkloadConfig(), seed=1, block_size=BS, device="meta")
    s, batch, common = sc.next_batch()
    with no_host_sync():
        meta = SparseIndexerBuilder(BS, 100).build(common)
    assert sum(c.tok_end - c.tok_start for c in meta.prefill_chunks) + meta.num_decode_tokens \
        == s.total_num_scheduled_tokens
    with pytest.raises(ValueError, match="captures uniform batches only"):
        SparseIndexerBuilder(BS, 100).build(common, GraphKey(common.num_reqs,
                                                             common.num_tokens_padded, 128, False))
    with pytest.raises(ValueError, match="topk = 0"):
        SparseIndexerImpl(H, D, HKV, 0)
    with pytest.raises(ValueError, match="kernel = 'cuda', expected one of"):
        SparseIndexerImpl(H, D, HKV, 2, kernel="cuda")
    with pytest.raises(ValueError, match="logits_budget=0"):
        SparseIndexerBuilder(BS, 0)
