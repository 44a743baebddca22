"""The attention / KV-write custom ops on every kernel against a float64 dense reference:
mixed batches, padded rows and tokens, spec-decode rows, GQA, sliding window, softcap, sinks,
split-KV; under no_host_sync, captured in CUDA graphs, and compiled without cache copies."""

import pytest
import torch

from graphattn.backends.kernels import allocate_kv_cache
from graphattn.backends.ops import kv_bounds, resolve_kernel, split_plan
from graphattn.backends.paged import PagedAttentionBuilder, PagedAttentionImpl
from graphattn.sync import no_host_sync
from graphattn.workload import WorkloadConfig
from tests.graphattn.backends.harness import Scenario, dense_attention

CFGS = {
    "mixed": WorkloadConfig(prompt_len=(3, 60), token_budget=48),
    "decode": WorkloadConfig(prompt_len=(1, 1), max_new_tokens=(30, 90), arrival_prob=1.0),
    "spec_async": WorkloadConfig(num_spec_tokens=2, feedback_delay=3, token_budget=48),
}
FEATURES = {"plain": {}, "window": {"window": 5}, "softcap": {"softcap": 2.0},
            "sinks": {"sinks": True}}


def run_steps(name, features, device, kernel, dtype, heads=(4, 2), d=16, steps=12, tol=1e-9,
              block_size=8, max_len=128):
    h, hkv = heads
    sc = Scenario(CFGS[name], seed=7, max_model_len=max_len, block_size=block_size,
                  device=device)
    feats = dict(features)
    if feats.pop("sinks", False):
        feats["sinks"] = (torch.randn(h, dtype=torch.float64) * 2).to(device, dtype)
    impl = PagedAttentionImpl(h, d, hkv, kernel=kernel, **feats)
    builder = PagedAttentionBuilder(block_size, CFGS[name].num_spec_tokens + 1)
    caches = tuple(allocate_kv_cache(sc.num_blocks, block_size, hkv, d, dtype, device)
                   for _ in range(2))
    for _ in range(steps):
        s, batch, common = sc.next_batch(1, 3)
        t = batch.num_tokens_padded
        q, k, v = sc.rand(t, h, d), sc.rand(t, hkv, d), sc.rand(t, hkv, d)
        dev = [x.to(device, dtype) for x in (q, k, v)]
        with no_host_sync():
            out = impl.forward(*dev, caches, builder.build(common))
        n = s.total_num_scheduled_tokens
        # the reference sees what the cache holds (rounded to its dtype)
        sc.record(s, batch, torch.stack([k[:n], v[:n]], 1).to(dtype).double())
        _, slots, pos = sc.token_views(s, batch)
        got = out.double().cpu()
        for i in range(n):
            kv = sc.logical[int(slots[i])][: pos[i] + 1]
            ref = dense_attention(q[i].to(dtype).double(), kv[:, 0], kv[:, 1], impl.scale,
                                  impl.window, impl.softcap, impl.sinks)
            torch.testing.assert_close(got[i], ref, rtol=tol, atol=tol)
        assert got[n:].abs().sum().item() == 0.0  # padded tokens
        sc.finish(s)


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("name", sorted(CFGS))
def test_torch_kernel_float64(name, feature):
    run_steps(name, FEATURES[feature], "cpu", "torch", torch.float64)


def test_kernel_choice():
    assert resolve_kernel("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="kernel 'triton' needs CUDA"):
        resolve_kernel("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="kernel = 'fast'"):
        PagedAttentionImpl(4, 8, 2, kernel="fast")
    with pytest.raises(ValueError, match=r"sinks has shape \(3,\), expected \(4,\)"):
        PagedAttentionImpl(4, 8, 2, sinks=torch.zeros(3))


def test_split_plan_from_cpu_numbers():
    assert split_plan(1, 8, 2048, 64) == (32, 64)  # few rows: split the KV axis
    assert split_plan(128, 8, 2048, 64) == (1, 2048)  # enough programs already
    splits, length = split_plan(3, 2, 100, 64)
    assert splits * length >= 100 and length % 64 == 0


@pytest.mark.cuda
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("name", sorted(CFGS))
@pytest.mark.parametrize("heads, d", [((4, 2), 16), ((8, 1), 64), ((4, 4), 128)])
def test_triton_matches_float64_reference(name, feature, heads, d):
    run_steps(name, FEATURES[feature], "cuda", "triton", torch.bfloat16, heads, d, steps=6,
              tol=2e-2)
    run_steps(name, FEATURES[feature], "cuda", "triton", torch.float32, heads, d, steps=4,
              tol=2e-3)


@pytest.mark.cuda
def test_triton_split_kv_long_rows():
    # few long decode rows: the KV axis is split and merged by LSE
    run_steps("decode", {}, "cuda", "triton", torch.float32, (8, 2), 64, steps=4, tol=2e-3,
              block_size=16, max_len=2048)


@pytest.mark.cuda
def test_triton_write_kv_and_graph_replay_reads_device_lengths():
    torch.manual_seed(0)
    h, hkv, d, bs, rows, nblk = 8, 2, 64, 16, 4, 8
    kc, vc = (torch.randn(rows * nblk + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
              for _ in range(2))
    bt = torch.arange(rows * nblk, device="cuda", dtype=torch.int32).view(rows, nblk)
    qsl = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    seq = torch.tensor([5, 17, 64, 100], device="cuda", dtype=torch.int32)
    q = torch.randn(rows, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(rows, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    slots = (bt[torch.arange(rows), (seq - 1) // bs] * bs + (seq - 1) % bs).long()
    slots[1] = -1  # a padded token writes nowhere

    def step():
        torch.ops.graphattn.write_kv(k, v, kc, vc, slots, "triton")
        return torch.ops.graphattn.paged_attention(q, kc, vc, qsl, seq, bt, slots, d ** -0.5,
                                                   rows, 1, kv_bounds(nblk, nblk * bs), 0, 0.0,
                                                   None, "triton")

    def reference():
        out = torch.ops.graphattn.paged_attention(q.double(), kc.double(), vc.double(), qsl, seq,
                                                  bt, slots, d ** -0.5, rows, 1,
                                                  kv_bounds(nblk, nblk * bs), 0, 0.0, None,
                                                  "torch")
        return out.float()

    before = kc.clone()
    step()
    written = slots >= 0
    flat = kc.view(-1, hkv, d)
    torch.testing.assert_close(flat[slots[written]], k[written])
    assert torch.equal(flat[: slots[0]], before.view(-1, hkv, d)[: slots[0]])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for lens in ([1, 128, 30, 7], [64, 64, 64, 64], [100, 3, 128, 77]):
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        slots.copy_((bt[torch.arange(rows), (seq - 1) // bs] * bs + (seq - 1) % bs).long())
        with no_host_sync():
            g.replay()
        torch.testing.assert_close(out.float(), reference(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize(("rows", "qd"), [(3, 1), (1, 3), (3, 3)])
def test_custom_ops_agree_with_their_fake_implementations(device, rows, qd):
    """torch.library.opcheck and the fake's layout (inductor asserts it on the real output)
    on uniform rows of `qd` query tokens."""
    g = torch.Generator().manual_seed(qd)
    bs, h, hkv, d = 8, 4, 2, 16
    nblk = 4
    kc, vc = (torch.randn(rows * nblk + 1, bs, hkv, d, generator=g).to(device) for _ in range(2))
    t = rows * qd + 2  # two padded tokens
    q = torch.randn(t, h, d, generator=g).to(device)
    qsl = torch.arange(0, (rows + 1) * qd, qd, dtype=torch.int32, device=device)
    seq = torch.tensor([9, 20, 31][:rows], dtype=torch.int32, device=device)
    bt = torch.randperm(rows * nblk, generator=g).int().view(rows, nblk).to(device)
    slots = torch.full((t,), -1, dtype=torch.int64, device=device)
    args = (q, kc, vc, qsl, seq, bt, slots, d ** -0.5, rows, qd, kv_bounds(nblk, nblk * bs), 0,
            0.0, None, "auto")
    torch.library.opcheck(torch.ops.graphattn.paged_attention.default, args)
    out = torch.ops.graphattn.paged_attention(*args)
    assert out.is_contiguous()  # inductor asserts the fake's strides on the real output
    k, v = torch.randn(t, hkv, d, generator=g).to(device), torch.randn(t, hkv, d).to(device)
    slots[: rows * qd] = torch.arange(rows * qd, device=device)
    torch.library.opcheck(torch.ops.graphattn.write_kv.default, (k, v, kc, vc, slots, "auto"))


def test_kv_bounds_must_live_on_the_host():
    q = torch.zeros(1, 2, 8)
    kc = torch.zeros(2, 4, 1, 8)
    args = (q, kc, kc, torch.tensor([0, 1], dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), 1.0, 1, 1)
    bad = torch.tensor([1, 4, 0])  # a device tensor is refused by the same check
    with pytest.raises(ValueError, match=r"kv_bounds must be an int64 CPU tensor of shape "
                                         r"\(2,\) .* got shape \(3,\) on cpu"):
        torch.ops.graphattn.paged_attention(*args, bad, 0, 0.0, None, "torch")
    out = torch.ops.graphattn.paged_attention(*args, kv_bounds(1, 4), 0, 0.0, None, "torch")
    assert out.shape == (1, 2, 8)
