import numpy as np
import pytest
import torch

from bench.workload import WorkloadConfig
from graphattn.backends.cross import CrossAttentionBuilder, CrossAttentionImpl
from graphattn.backends.reference import allocate_kv_cache
from graphattn.keys import GraphKey
from graphattn.sync import no_host_sync
from tests.graphattn.backends.harness import Scenario, dense_attention

H, HKV, D, BS, MAXE = 4, 2, 8, 4, 24


def run(device, steps=20, spec=0, pad=(0, 0)):
    sc = Scenario(WorkloadConfig(num_spec_tokens=spec, feedback_delay=2, token_budget=32),
                  seed=7 + spec, device=device)
    n_slots = sc.state.max_num_reqs
    eblocks = -(-MAXE // BS)
    cross_bt_np = np.arange(n_slots * eblocks, dtype=np.int32).reshape(n_slots, eblocks)
    caches = tuple(allocate_kv_cache(n_slots * eblocks, BS, HKV, D,
                                     torch.float64 if device == "cpu" else torch.float32, device)
                   for _ in range(2))
    enc_len = np.zeros(n_slots, np.int32)
    enc_kv: dict[int, torch.Tensor] = {}
    builder, impl = CrossAttentionBuilder(BS, MAXE), CrossAttentionImpl(H, D, HKV)
    for _ in range(steps):
        s, batch, common = sc.next_batch(*pad)
        rows = batch.num_reqs_padded
        slots = batch.req_slots_np
        new_rows = (common.num_computed_tokens_cpu_upper_bound == 0) & (common.query_lens_cpu > 0)
        for r in np.flatnonzero(new_rows):
            enc_len[slots[r]] = sc.rng.integers(1, MAXE + 1)
            enc_kv[int(slots[r])] = sc.rand(int(enc_len[slots[r]]), 2, HKV, D)
        row_enc = np.where(np.arange(rows) < s.num_reqs, enc_len[slots], 0)
        bt_np = cross_bt_np[slots]
        enc_new = [enc_kv[int(slots[r])] for r in np.flatnonzero(new_rows)]
        ek = torch.cat([e[:, 0] for e in enc_new]) if enc_new else None
        ev = torch.cat([e[:, 1] for e in enc_new]) if enc_new else None
        q = sc.rand(batch.num_tokens_padded, H, D)
        with no_host_sync():
            meta = builder.build(common, row_enc, bt_np, torch.from_numpy(bt_np).to(device))
            out = impl.forward(q.to(caches[0]), None if ek is None else ek.to(caches[0]),
                               None if ev is None else ev.to(caches[0]), caches, meta)
        if device == "meta":
            assert out.shape == q.shape
        else:
            assert meta.num_cache_decodes == int((common.num_computed_tokens_cpu_upper_bound
                                                  > 0).sum())
            n = s.total_num_scheduled_tokens
            tok_rows = batch.req_indices_np[:n]
            for i in range(n):
                e = enc_kv[int(slots[tok_rows[i]])]
                ref = dense_attention(q[i], e[:, 0], e[:, 1], impl.scale)
                torch.testing.assert_close(out[i].double().cpu(), ref, rtol=1e-5, atol=1e-5)
            assert out[n:].abs().sum().item() == 0.0
        sc.sched.finish_step(s)


@pytest.mark.parametrize("spec, pad", [(0, (0, 0)), (2, (2, 3))])
def test_matches_dense_reference(spec, pad):
    run("cpu", spec=spec, pad=pad)


def test_meta_device():
    run("meta", steps=6)


def test_graph_key_rejects_encoder_writes_and_bad_input():
    sc = Scenario(WorkloadConfig(), seed=0)
    s, batch, common = sc.next_batch()
    builder = CrossAttentionBuilder(BS, MAXE)
    bt = np.zeros((common.num_reqs, 6), np.int32)
    enc = np.full(common.num_reqs, 5, np.int32)
    key = GraphKey(common.num_reqs, common.num_tokens_padded, 128, False)
    with pytest.raises(ValueError, match="cannot write encoder tokens"):
        builder.build(common, enc, bt, torch.from_numpy(bt), key)
    with pytest.raises(ValueError, match=r"encoder_seq_lens_np\[0\] = 35, expected in \[0, 24\]"):
        builder.build(common, enc + 30, bt, torch.from_numpy(bt))
    with pytest.raises(ValueError, match=r"encoder_seq_lens_np\[0\] = -1, expected in \[0, 24\]"):
        builder.build(common, enc - 6, bt, torch.from_numpy(bt))
    with pytest.raises(ValueError, match=r"expected \(\d+,\) and \(\d+, blocks\)"):
        builder.build(common, enc[:-1], bt, torch.from_numpy(bt))
    narrow = bt[:, :1]  # 1 block of 4 for an encoder of 20
    with pytest.raises(ValueError, match="cross_block_table_np has 1 columns .* expected >= 5"):
        builder.build(common, enc + 15, narrow, torch.from_numpy(narrow))
