"""Shared-prefix (cascade) attention, ``torch.ops.graphattn.cascade_attention``, against a
float64 dense reference on fresh random caches: rows of the group mixed with rows outside
it, padded rows, a sliding window that starts inside the prefix, soft caps and sinks, under
no_host_sync(); and the CPU rule that picks the group (`graphattn.cascade`)."""

import numpy as np
import pytest
import torch

from graphattn.backends.ops import kv_bounds
from graphattn.cascade import plan_shared_prefix
from graphattn.state import RequestState
from graphattn.sync import no_host_sync

FEATURES = {"plain": {}, "window": {"window": 6}, "softcap": {"softcap": 5.0},
            "sinks": {"sinks": True}}
BS = 4


def case(device, dtype, q_len=2, h=4, hkv=2, d=16, seed=0):
    """Rows 0, 1 and 3 share blocks 0-2 (12 tokens); row 2 holds its own; row 4 is padded.
    Every row has `q_len` query tokens at its end (spec-decode verify rows)."""
    g = torch.Generator().manual_seed(seed)
    nblk, max_blocks = 24, 6
    lens = [18, 21, 17, 14, 0]
    table = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 6, 7, 8], [9, 10, 11, 12, 13, 14],
                          [0, 1, 2, 15, 16, 17], [0] * max_blocks], dtype=torch.int32)
    qlens = [q_len if n else 0 for n in lens]
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens)]), dtype=torch.int32)
    t = int(qsl[-1]) + 3  # padded tokens after the last row
    kc = torch.randn(nblk + 1, BS, hkv, d, generator=g, dtype=torch.float64)
    vc = torch.randn(nblk + 1, BS, hkv, d, generator=g, dtype=torch.float64)
    q = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    slots = torch.full((t,), -1, dtype=torch.int64)
    for r, n in enumerate(lens):
        for j in range(qlens[r]):
            p = n - qlens[r] + j
            slots[qsl[r] + j] = table[r, p // BS] * BS + p % BS
    shared = torch.tensor([1, 1, 0, 1, 0], dtype=torch.int32)
    put = {"q": q, "k_cache": kc, "v_cache": vc}
    tensors = {k: v.to(device, dtype) for k, v in put.items()}
    tensors.update(query_start_loc=qsl.to(device), seq_lens=torch.tensor(
        lens, dtype=torch.int32, device=device), block_table=table.to(device),
        slot_mapping=slots.to(device), shared_rows=shared.to(device))
    return tensors, (q, kc, vc, table, lens, qsl)


def dense_reference(q, kc, vc, table, lens, qsl, window, softcap, sinks, scale):
    """float64 per token: softmax over its row's keys [pos - window + 1, pos]."""
    out = torch.zeros(q.shape[0], q.shape[1], vc.shape[-1], dtype=torch.float64)
    g = q.shape[1] // kc.shape[2]
    for r, n in enumerate(lens):
        for tok in range(int(qsl[r]), int(qsl[r + 1])):
            pos = n - (int(qsl[r + 1]) - tok)
            lo = max(0, pos - window + 1) if window else 0
            keys = torch.arange(lo, pos + 1)
            blocks = table[r, keys // BS].long()
            k = kc[blocks, keys % BS].repeat_interleave(g, 1)  # [L, H, D]
            v = vc[blocks, keys % BS].repeat_interleave(g, 1)
            s = torch.einsum("hd,lhd->hl", q[tok], k) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None]], 1)
                v = torch.cat([v, torch.zeros_like(v[:1])])
            out[tok] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)
    return out


def run_cascade(device, dtype, kernel, feature, shared_prefix=8, q_len=2, uniform=True):
    """`uniform`: every row declared a `q_len`-token decode row (the suffix pass splits each
    row's keys); otherwise mixed rows (one tile per row's tokens)."""
    f = FEATURES[feature]
    tensors, ref_in = case(device, dtype, q_len)
    tensors["shared_rows"] = tensors["shared_rows"] * shared_prefix  # each member's start
    h = tensors["q"].shape[1]
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(3)) if f.get(
        "sinks") else None
    window, softcap, scale = f.get("window", 0), f.get("softcap", 0.0), 0.3
    dev_sinks = None if sinks is None else sinks.to(device, dtype)
    with no_host_sync():
        out = torch.ops.graphattn.cascade_attention(
            tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors["query_start_loc"],
            tensors["seq_lens"], tensors["block_table"], tensors["slot_mapping"], scale,
            5 if uniform else 0, q_len, kv_bounds(6, 24), tensors["shared_rows"],
            shared_prefix, window, softcap, dev_sinks, kernel)
    want = dense_reference(*ref_in, window, softcap, sinks, scale)
    return out, want


@pytest.mark.parametrize("shared_prefix", [4, 8, 12])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_torch_cascade_matches_float64_dense(feature, shared_prefix):
    out, want = run_cascade("cpu", torch.float64, "torch", feature, shared_prefix)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


@pytest.mark.cuda
@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_triton_cascade_matches_float64_dense(feature, q_len, uniform):
    out, want = run_cascade("cuda", torch.float32, "triton", feature, 8, q_len, uniform)
    # float32 dots run in TF32 on tensor cores (as in test_ops' float32 rows)
    torch.testing.assert_close(out.double().cpu(), want, rtol=3e-3, atol=3e-3)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_cascade_agrees_with_its_fake_and_refuses_a_partial_block(device):
    tensors, _ = case(device, torch.float32)
    args = [tensors[k] for k in ("q", "k_cache", "v_cache", "query_start_loc", "seq_lens",
                                 "block_table", "slot_mapping")]
    if device == "cpu":
        with pytest.raises(ValueError, match="shared_prefix = 6, expected a positive multiple"):
            torch.ops.graphattn.cascade_attention(*args, 0.3, 5, 1, kv_bounds(6, 24),
                                                  tensors["shared_rows"], 6, 0, 0.0, None,
                                                  "torch")
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.graphattn.cascade_attention(*args, 0.3, 5, 1, kv_bounds(6, 24),
                                                    tensors["shared_rows"], 8, 0, 0.0, None,
                                                    "torch")
    assert tuple(out.shape) == tuple(tensors["q"].shape)


def test_rule_groups_rows_by_their_most_common_first_block():
    st = RequestState(6, 64, 4, "cpu", num_kv_blocks=60)
    prefix = [0, 1, 2, 3]
    st.add_request("a", 20, prefix + [10], num_computed_tokens=16)
    st.add_request("b", 20, prefix + [11], num_computed_tokens=16)
    st.add_request("c", 20, [20, 21, 22, 23, 24], num_computed_tokens=16)
    st.add_request("d", 20, prefix[:3] + [30, 31], num_computed_tokens=12)
    slots = np.arange(4, dtype=np.int32)
    for sizes, want, members in [((8,), 8, [1, 1, 0, 1]), ((8, 12), 12, [1, 1, 0, 1]),
                                 ((16,), 0, None), ((), 0, None)]:
        p, group = plan_shared_prefix(st, slots, sizes)
        assert p == want
        assert (group is None and members is None) or group.tolist() == [bool(m) for m
                                                                         in members]
    # a member whose computed tokens lag (blocks still being written) limits the prefix
    st.num_computed_tokens_np[3] = 5
    assert plan_shared_prefix(st, slots, (4, 8))[0] == 4
    assert plan_shared_prefix(st, slots[2:3], (4,)) == (0, None)
