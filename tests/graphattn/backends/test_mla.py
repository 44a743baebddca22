import pytest
import torch

from bench.workload import WorkloadConfig
from graphattn.backends.mla import MLABuilder, MLAImpl
from graphattn.backends.reference import allocate_kv_cache
from graphattn.keys import GraphKey
from graphattn.sync import no_host_sync
from tests.graphattn.backends.harness import Scenario

H, LORA, ROPE, BS = 4, 12, 4, 4


def reference(q, entries, scale):
    s = torch.einsum("hd,ld->hl", q.double(), entries.double()) * scale
    return s.softmax(-1) @ entries[:, :LORA].double()


@pytest.mark.parametrize("spec, workspace, pad", [(0, 16, (0, 0)), (0, 64, (2, 3)),
                                                  (2, 12, (1, 1))])
def test_matches_dense_reference(spec, workspace, pad):
    cfg = WorkloadConfig(prompt_len=(5, 40), token_budget=20, num_spec_tokens=spec,
                         feedback_delay=2)
    sc = Scenario(cfg, seed=11 + workspace, block_size=BS)
    cache = allocate_kv_cache(sc.num_blocks, BS, 1, LORA + ROPE, torch.float64, "cpu")
    builder, impl = MLABuilder(BS, workspace, spec + 1), MLAImpl(H, LORA, ROPE, 0.3)
    chunks = 0
    for _ in range(30):
        s, batch, common = sc.next_batch(*pad)
        t = batch.num_tokens_padded
        q, kv_c, k_pe = sc.rand(t, H, LORA + ROPE), sc.rand(t, LORA), sc.rand(t, ROPE)
        with no_host_sync():
            meta = builder.build(common)
            out = impl.forward(q, kv_c, k_pe, cache, meta)
        chunks = max(chunks, meta.num_chunks)
        assert meta.num_prefills * meta.chunk_size <= max(workspace, BS)
        n = s.total_num_scheduled_tokens
        sc.record(s, batch, torch.cat([kv_c, k_pe], -1)[:n])
        _, slots, pos = sc.token_views(s, batch)
        for i in range(n):
            entries = sc.logical[int(slots[i])][: pos[i] + 1]
            torch.testing.assert_close(out[i], reference(q[i], entries, 0.3), rtol=1e-6,
                                       atol=1e-6)
        assert out[n:].abs().sum().item() == 0.0
        sc.finish(s)
    if workspace <= 16:
        assert chunks >= 2  # the workspace really forced chunked context


def test_plan_from_bound_and_errors():
    sc = Scenario(WorkloadConfig(prompt_len=(30, 40), token_budget=8), seed=3, block_size=BS)
    s, batch, common = sc.next_batch()
    sc.finish(s)
    s, batch, common = sc.next_batch()
    meta = MLABuilder(BS, 8).build(common)
    assert meta.context_lens_cpu.tolist() == common.num_computed_tokens_cpu_upper_bound[
        meta.num_decodes: meta.num_decodes + meta.num_prefills].tolist()
    with pytest.raises(ValueError, match="cannot hold one block of 4 tokens for each of"):
        MLABuilder(BS, 3).build(common)
    with pytest.raises(ValueError, match="captures uniform batches only"):
        MLABuilder(BS, 8).build(common, GraphKey(common.num_reqs, common.num_tokens_padded,
                                                 128, False))


def test_meta_device():
    sc = Scenario(WorkloadConfig(prompt_len=(5, 30), token_budget=12), seed=5, block_size=BS,
                  device="meta")
    cache = allocate_kv_cache(sc.num_blocks, BS, 1, LORA + ROPE, torch.float32, "meta")
    builder, impl = MLABuilder(BS, 16), MLAImpl(H, LORA, ROPE, 0.3)
    for _ in range(6):
        s, batch, common = sc.next_batch(1, 1)
        t = batch.num_tokens_padded
        with no_host_sync():
            out = impl.forward(torch.empty(t, H, LORA + ROPE, device="meta"),
                               torch.empty(t, LORA, device="meta"),
                               torch.empty(t, ROPE, device="meta"), cache, builder.build(common))
        assert out.shape == (t, H, LORA)
        sc.sched.finish_step(s)
