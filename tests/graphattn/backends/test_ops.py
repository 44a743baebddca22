"""The attention / KV-write custom ops on every kernel against a float64 dense reference:
mixed batches, padded rows and tokens, spec-decode rows, GQA, sliding window, softcap, sinks,
split-KV; under no_host_sync, captured in CUDA graphs, and compiled without cache copies."""

import pytest
import torch

from bench.workload import WorkloadConfig
from graphattn.backends import launch_config, triton_launch
from graphattn.backends.launch_config import TritonConfig, resolve_kernel, split_plan
from graphattn.backends.ops import kv_bounds
from graphattn.backends.paged import PagedAttentionBuilder, PagedAttentionImpl
from graphattn.backends.reference import (
    allocate_kv_cache,
    gather_paged_attention,
    to_cache_values,
)
from graphattn.backends.triton_launch import Append, triton_attention
from graphattn.sync import no_host_sync
from tests.graphattn.backends.harness import Scenario, dense_attention

CFGS = {
    "mixed": WorkloadConfig(prompt_len=(3, 60), token_budget=48),
    "decode": WorkloadConfig(prompt_len=(1, 1), max_new_tokens=(30, 90), arrival_prob=1.0),
    "spec_async": WorkloadConfig(num_spec_tokens=2, feedback_delay=3, token_budget=48),
}
FEATURES = {"plain": {}, "window": {"window": 5}, "softcap": {"softcap": 2.0},
            "sinks": {"sinks": True}}


def run_steps(name, features, device, kernel, dtype, heads=(4, 2), d=16, steps=12, tol=1e-9,
              block_size=8, max_len=128, cache_dtype=None, scales=(1.0, 1.0)):
    """`cache_dtype` torch.float8_e4m3fn: an fp8 cache with (k_scale, v_scale) `scales`,
    checked against the reference of what it holds (dequantized)."""
    h, hkv = heads
    cache_dtype = cache_dtype or dtype
    sc = Scenario(CFGS[name], seed=7, max_model_len=max_len, block_size=block_size,
                  device=device)
    feats = dict(features)
    if feats.pop("sinks", False):
        feats["sinks"] = (torch.randn(h, dtype=torch.float64) * 2).to(device, dtype)
    impl = PagedAttentionImpl(h, d, hkv, kernel=kernel, k_scale=scales[0], v_scale=scales[1],
                              **feats)
    builder = PagedAttentionBuilder(block_size, CFGS[name].num_spec_tokens + 1)
    caches = tuple(allocate_kv_cache(sc.num_blocks, block_size, hkv, d, cache_dtype, device)
                   for _ in range(2))
    for _ in range(steps):
        s, batch, common = sc.next_batch(1, 3)
        t = batch.num_tokens_padded
        q, k, v = sc.rand(t, h, d), sc.rand(t, hkv, d), sc.rand(t, hkv, d)
        dev = [x.to(device, dtype) for x in (q, k, v)]
        with no_host_sync():
            out = impl.forward(*dev, caches, builder.build(common))
        n = s.total_num_scheduled_tokens
        # the reference sees what the cache holds (rounded to its dtype, dequantized)
        held = [to_cache_values(x[:n].to(dtype), cache_dtype, sc_).to(cache_dtype).double()
                * sc_ for x, sc_ in ((k, scales[0]), (v, scales[1]))]
        sc.record(s, batch, torch.stack(held, 1))
        _, slots, pos = sc.token_views(s, batch)
        got = out.double().cpu()
        for i in range(n):
            kv = sc.logical[int(slots[i])][: pos[i] + 1]
            ref = dense_attention(q[i].to(dtype).double(), kv[:, 0], kv[:, 1], impl.scale,
                                  impl.window, impl.softcap, impl.sinks)
            torch.testing.assert_close(got[i], ref, rtol=tol, atol=tol)
        assert got[n:].abs().sum().item() == 0.0  # padded tokens
        sc.finish(s)


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("name", sorted(CFGS))
@pytest.mark.parametrize("feature", ["plain", "sinks"])
def test_torch_kernel_reads_an_fp8_cache_with_its_scales(name, feature):
    """K stored as K / 0.5 and V as V / 2 in float8_e4m3fn: attention equals the dense
    reference over the dequantized cache."""
    run_steps(name, FEATURES[feature], "cpu", "torch", torch.float32, steps=6, tol=1e-5,
              cache_dtype=FP8, scales=(0.5, 2.0))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(CFGS))
def test_triton_kernel_reads_an_fp8_cache_with_its_scales(name, dtype):
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3  # float32: TF32 dots
    run_steps(name, {}, "cuda", "triton", dtype, heads=(8, 2), d=64, tol=tol,
              cache_dtype=FP8, scales=(0.5, 2.0))


def test_fp8_writes_clamp_to_the_finite_range():
    cache = allocate_kv_cache(2, 4, 1, 2, FP8, "cpu")
    k = torch.tensor([[[1000.0, -3.0]], [[0.5, 600.0]]])
    torch.ops.graphattn.write_kv(k, k, cache, cache.clone(), torch.tensor([0, 5]), "torch",
                                 2.0, 1.0)
    flat = cache.view(-1, 2).float()
    assert flat[0].tolist() == [448.0, -1.5]
    assert flat[5].tolist() == [0.25, 288.0]  # 300 rounds to e4m3's 288 (steps of 32 there)


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
    assert split_plan(1, 8, 2048, 64) == 32  # few rows: split the KV axis
    assert split_plan(128, 8, 2048, 64) == 1  # enough programs already
    assert split_plan(3, 2, 100, 64) == 2  # at most one split per block_n keys of the bound


def test_split_counters_are_zeroed_kept_and_grown_per_stream():
    counters = triton_launch.SplitCounters()
    cpu = torch.device("cpu")
    first = counters.get(cpu, 10)
    assert first.dtype == torch.int32 and first.numel() >= 10 and int(first.abs().sum()) == 0
    assert counters.get(cpu, first.numel()) is first  # one buffer while it is big enough
    bigger = counters.get(cpu, first.numel() + 1)
    assert bigger.numel() > first.numel() and int(bigger.abs().sum()) == 0
    assert counters.buffers(cpu) == [first, bigger]  # graphs may hold the old one


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


def decode_rows(lens, nblk, h=8, hkv=2, d=64, bs=16, device="cuda", dtype=torch.bfloat16):
    """Random caches, a block table, one query token per row at device lengths `lens`:
    (k_cache, v_cache, block_table, query_start_loc, seq_lens, q)."""
    rows = len(lens)
    kc, vc = (torch.randn(rows * nblk + 1, bs, hkv, d, device=device, dtype=dtype)
              for _ in range(2))
    bt = torch.arange(rows * nblk, device=device, dtype=torch.int32).view(rows, nblk)
    qsl = torch.arange(rows + 1, device=device, dtype=torch.int32)
    seq = torch.tensor(lens, device=device, dtype=torch.int32)
    return kc, vc, bt, qsl, seq, torch.randn(rows, h, d, device=device, dtype=dtype)


def split_fold_case(device: str, dtype: torch.dtype):
    """Three decode rows of up to 256 keys split 8 ways (16 partials of 64-wide heads a
    program: the in-launch fold takes them 2 splits a load), with sinks. Returns
    (step(merge) -> output, reference() -> float64 output, (q, seq_lens))."""
    rows, h, d, bs, nblk = 3, 8, 64, 16, 16
    kc, vc, bt, qsl, seq, q = decode_rows([5, 200, 77], nblk, h=h, d=d, bs=bs, device=device,
                                          dtype=dtype)
    sinks = torch.randn(h, device=device)

    def step(merge: bool) -> torch.Tensor:
        return triton_attention(q, kc, vc, qsl, seq, bt, d ** -0.5, 1, nblk * bs, 0, 0.0, sinks,
                                config=TritonConfig(block_n=32, waves=8, merge=merge))

    def reference() -> torch.Tensor:
        return gather_paged_attention(
            q.double(), kc.double(), vc.double(), qsl, seq, bt,
            torch.zeros(rows, dtype=torch.int64, device=device), d ** -0.5, rows, 1, nblk,
            sinks=sinks.double())
    return step, reference, (q, seq)


@pytest.mark.cuda
def test_triton_write_kv_and_graph_replay_reads_device_lengths():
    torch.manual_seed(0)
    h, hkv, d, bs, rows, nblk = 8, 2, 64, 16, 4, 8
    kc, vc, bt, qsl, seq, q = decode_rows([5, 17, 64, 100], nblk, h, hkv, d, bs)
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


def test_kv_bounds_is_one_static_host_tensor_per_value():
    """One tensor per bucket, marked as an unguarded static address (inductor's CUDA-graph
    trees take it as a static input); inside a traced function, a graph constant."""
    a = kv_bounds(3, 48)
    assert a is kv_bounds(3, 48) and a is not kv_bounds(3, 64)
    assert a.tolist() == [3, 48] and a.dtype == torch.int64 and a.device.type == "cpu"
    assert getattr(a, "_dynamo_static_input_type", None) == "unguarded"
    torch._dynamo.reset()
    traced = torch.compile(lambda x: x * kv_bounds(2, 8)[1], fullgraph=True, backend="eager")
    assert traced(torch.ones(2)).tolist() == [8.0, 8.0]


@pytest.mark.cuda
def test_reduce_overhead_around_the_ops_records_a_graph_per_length_bucket():
    """torch.compile(mode="reduce-overhead", fullgraph=True) around the KV write and the
    attention: steps of two length buckets with the same shapes, alternating, each matching
    eager (kv_bounds a static input: no staging into the graph pool, no replay of one
    bucket's launch for another)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    h, hkv, d, bs, rows, nblk = 8, 2, 64, 16, 4, 64
    kc, vc, bt, qsl, seq, q = decode_rows([5] * rows, nblk, h, hkv, d, bs)
    for c in (kc, vc):
        torch._dynamo.mark_static_address(c)
    k, v = (torch.randn(rows, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def step(q, k, v, seq, slots, bounds):
        torch.ops.graphattn.write_kv(k, v, kc, vc, slots, "triton")
        return torch.ops.graphattn.paged_attention(q, kc, vc, qsl, seq, bt, slots, d ** -0.5,
                                                   rows, 1, bounds, 0, 0.0, None, "triton")

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    cases = [([5, 17, 30, 2], 2), ([700, 1000, 64, 1024], 64)]
    for lens, nb in cases * 2:
        seq = torch.tensor(lens, device="cuda", dtype=torch.int32)
        slots = (bt[torch.arange(rows), (seq - 1) // bs] * bs + (seq - 1) % bs).long()
        bounds = kv_bounds(nb, nb * bs)
        for _ in range(3):  # warm-up, record, replay
            out = compiled(q, k, v, seq, slots, bounds).clone()
        ref = step(q, k, v, seq, slots, bounds)
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def _rope_reference(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """float64 rotation of NeoX halves as complex numbers: (x1 + i x2) * e^(i pos f)."""
    d = x.shape[-1]
    f = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double())
    z = z * torch.polar(torch.ones_like(f), pos.double()[:, None] * f)[:, None]
    return torch.cat([z.real, z.imag], -1)


def _rope_case(device, dtype, h=6, hkv=2, d=32, t=7, seed=0):
    from graphattn.backends.rope import inv_frequencies

    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(device, dtype)
    pos = torch.randint(0, 4096, (t,), generator=g).to(device)
    slots = torch.randperm(40, generator=g)[:t].to(device)
    slots[2] = -1  # a padded token
    caches = [torch.randn(6, 8, hkv, d, generator=g).to(device, dtype) for _ in range(2)]
    return qkv, pos, inv_frequencies(d, 10000.0, device), caches, slots, (h, hkv, d)


@pytest.mark.parametrize(("device", "kernel", "dtype", "tol"), [
    ("cpu", "torch", torch.float32, 1e-3),  # float32 angles at positions up to 4096
    pytest.param("cuda", "triton", torch.float32, 1e-3, marks=pytest.mark.cuda),
    pytest.param("cuda", "triton", torch.bfloat16, 2e-2, marks=pytest.mark.cuda)])
def test_rope_write_kv_matches_float64_rotation(device, kernel, dtype, tol):
    """q returned rotated, k rotated and v written to their slots, slot -1 written nowhere
    (the torch path parks it in the sink block, past every real slot); under no_host_sync."""
    qkv, pos, inv, (kc, vc), slots, (h, hkv, d) = _rope_case(device, dtype)
    before = [c.clone() for c in (kc, vc)]
    with no_host_sync():
        q = torch.ops.graphattn.rope_write_kv(qkv, pos, inv, kc, vc, slots, h, hkv, kernel)
    x = qkv.double().cpu().view(qkv.shape[0], h + 2 * hkv, d)
    p = pos.cpu()
    torch.testing.assert_close(q.double().cpu(), _rope_reference(x[:, :h], p, 1e4), rtol=tol,
                               atol=tol)
    assert q.is_contiguous() and q.dtype == dtype
    ok = (slots >= 0).cpu()
    s = slots.cpu()[ok]
    k_ref = _rope_reference(x[:, h:h + hkv], p, 1e4)[ok]
    flat_k, flat_v = (c.view(-1, hkv, d).double().cpu() for c in (kc, vc))
    torch.testing.assert_close(flat_k[s], k_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(flat_v[s], x[:, h + hkv:][ok].to(dtype).double())
    real = kc.shape[0] * kc.shape[1] - kc.shape[1]  # slots before the sink block
    untouched = torch.ones(real, dtype=torch.bool)
    untouched[s] = False
    for c, b in zip((kc, vc), before, strict=True):
        assert torch.equal(c.view(-1, hkv, d)[:real][untouched.to(device)],
                           b.view(-1, hkv, d)[:real][untouched.to(device)])


def check_far_rotation(device: str) -> None:
    """Triton's `rope_write_kv` (its cos / sin: a reduction to [-pi, pi], then the hardware
    approximations) against torch's precise cos / sin on the same float32 angles, at positions
    up to 2**21 (the test below; the interpreter test on the CPU)."""
    qkv, pos, inv, caches, slots, (h, hkv, _) = _rope_case(device, torch.float32)
    pos[:4] = torch.tensor([300_000, 2 ** 20, 2 ** 21 - 1, 7])
    got, want = ([c.clone() for c in caches] for _ in range(2))
    q = torch.ops.graphattn.rope_write_kv(qkv, pos, inv, *got, slots, h, hkv, "triton")
    q_ref = torch.ops.graphattn.rope_write_kv(qkv, pos, inv, *want, slots, h, hkv, "torch")
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    s = slots[slots >= 0]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.flatten(0, 1)[s], b.flatten(0, 1)[s], rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_triton_rotation_matches_torch_at_far_positions():
    check_far_rotation("cuda")


def check_fp8_fused(device: str, dtype: torch.dtype = torch.float32, tol: float = 3e-2) -> None:
    """The fused rotary + write (`rope_write_kv`) and rotary + decode (`rope_paged_attention`)
    Triton kernels on an fp8 cache holding K / 0.5 and V / 2 against the plain-torch ops on
    the same cache: rotated queries, attention outputs and the written slots (the slots
    within one e4m3 step: the kernels' cos / sin may round a last bit the other way). The
    interpreter test runs it on the CPU."""
    qkv, pos, inv, kc, vc, qsl, seq, bt, slots = _decode_qkv_case(device, dtype)
    h, hkv, nblk, bs = 8, 2, 8, 8
    rows = bt.shape[0]
    caches = [to_cache_values(c, FP8, sc).to(FP8) for c, sc in ((kc, 0.5), (vc, 2.0))]
    written = slots[:rows]

    def run(kernel, decode):
        kv = [c.clone() for c in caches]
        with no_host_sync():
            if decode:
                out = torch.ops.graphattn.rope_paged_attention(
                    qkv, pos, inv, *kv, qsl, seq, bt, slots, 32 ** -0.5, h, hkv, rows, 1,
                    kv_bounds(nblk, nblk * bs), 0, 0.0, None, kernel, 0.5, 2.0)
            else:
                out = torch.ops.graphattn.rope_write_kv(qkv, pos, inv, *kv, slots, h, hkv,
                                                        kernel, 0.5, 2.0)
        return out[:rows].double().cpu(), [c.flatten(0, 1)[written].double().cpu() for c in kv]

    for decode in (False, True):
        (out, kv), (out_ref, kv_ref) = run("triton", decode), run("torch", decode)
        torch.testing.assert_close(out, out_ref, rtol=tol, atol=tol)
        for got, want in zip(kv, kv_ref, strict=True):
            assert ((got - want).abs() <= want.abs() / 8 + 1e-6).all()
            assert (got != want).double().mean() < 0.02


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rotary_kernels_write_and_read_an_fp8_cache(dtype):
    check_fp8_fused("cuda", dtype)


@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_rope_write_kv_agrees_with_its_fake_and_refuses_a_bad_qkv(device):
    qkv, pos, inv, (kc, vc), slots, (h, hkv, d) = _rope_case("cpu", torch.float32)
    args = [a.to(device) for a in (qkv, pos, inv, kc, vc, slots)]
    if device == "meta":  # the fake gives the shape without running anything
        q = torch.ops.graphattn.rope_write_kv(*args, h, hkv, "auto")
        assert q.shape == (qkv.shape[0], h, d) and q.device.type == "meta"
        return
    torch.library.opcheck(torch.ops.graphattn.rope_write_kv.default, (*args, h, hkv, "auto"))
    with pytest.raises(ValueError, match=r"qkv has shape \(7, 320\), expected \(7, 384\) for "
                                         r"8 heads, 2 KV heads, head_dim 32"):
        torch.ops.graphattn.rope_write_kv(*args, 8, hkv, "auto")


@pytest.mark.cuda
def test_triton_attention_writes_zeros_for_padded_tokens_without_a_fill():
    """The output is allocated empty (no memset node): tiles write the padded tokens' zeros,
    unsplit or split (the merge launch writes them), under a register cap and with the
    block table prefetched too, with no host read. The allocator is handed NaN-filled memory
    first."""

    torch.manual_seed(0)
    rows, h, hkv, d, bs, nblk = 4, 8, 2, 64, 16, 4
    kc, vc = (torch.randn(rows * nblk + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
              for _ in range(2))
    bt = torch.arange(rows * nblk, device="cuda", dtype=torch.int32).view(rows, nblk)
    qsl = torch.tensor([0, 1, 2, 2, 2], device="cuda", dtype=torch.int32)  # 2 padded rows
    seq = torch.tensor([9, 60, 0, 0], device="cuda", dtype=torch.int32)
    t = 4
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16)
    ref = gather_paged_attention(q.double(), kc.double(), vc.double(), qsl, seq, bt,
                                     torch.zeros(t, dtype=torch.int64, device="cuda"),
                                     d ** -0.5, 0, 1, nblk, 0, 0.0, None)
    for uniform, waves, pdl, regs, ahead in (
            (1, 0, False, 0, False), (0, 0, False, 0, False), (1, 64, False, 0, False),
            (1, 64, True, 0, False), (0, 0, True, 0, False), (1, 0, False, 64, False),
            (0, 0, False, 0, True), (1, 64, False, 0, True)):
        poison = torch.full((t, h, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        del poison
        cfg = TritonConfig(block_n=16, waves=waves, pdl=pdl, num_stages=3 if ahead else 2,
                           max_registers=regs, prefetch_pages=ahead)
        with no_host_sync():
            out = triton_attention(q, kc, vc, qsl, seq, bt, d ** -0.5, uniform, 64, 0, 0.0,
                                   None, config=cfg)
        assert out[2:].abs().sum().item() == 0 and out[:2].isfinite().all()
        torch.testing.assert_close(out[:2].double(), ref[:2], rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
def test_triton_pdl_launches_captured_in_a_graph_match_the_reference():
    """Programmatic dependent launch (where the GPU and Triton have it): attention and merge
    launches chained in one graph, replayed with new device lengths, against float64."""

    if not launch_config.has_pdl(torch.cuda.current_device()):
        pytest.skip("no programmatic dependent launch here")
    torch.manual_seed(0)
    rows, d, bs, nblk = 3, 64, 16, 16
    kc, vc, bt, qsl, seq, q = decode_rows([5, 200, 77], nblk, d=d, bs=bs)
    cfg = TritonConfig(block_n=32, waves=8, pdl=True)

    def step():
        a = triton_attention(q, kc, vc, qsl, seq, bt, d ** -0.5, 1, nblk * bs, 0, 0.0, None,
                              config=cfg)
        b = triton_attention(a, kc, vc, qsl, seq, bt, d ** -0.5, 1, nblk * bs, 0, 0.0, None,
                              config=cfg)  # reads what the previous launches wrote
        return a, b

    def reference(x):
        return gather_paged_attention(
            x.double(), kc.double(), vc.double(), qsl, seq, bt,
            torch.zeros(rows, dtype=torch.int64, device="cuda"), d ** -0.5, rows, 1, nblk)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        a, b = step()
    for lens in ([1, 256, 30], [100, 3, 255]):
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        with no_host_sync():
            g.replay()
        torch.testing.assert_close(a.double(), reference(q), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(b.double(), reference(a), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
def test_split_launches_merge_their_splits_themselves_eager_and_captured():
    """A split launch's last split merges (`TritonConfig.merge`), sinks included: eager, and
    in a graph captured on a stream whose warm-up made its counters, replayed with new
    device lengths under no_host_sync(); a capture on a stream without counters falls back
    to the merge kernel. Against float64, and every counter back at 0 after."""
    torch.manual_seed(0)
    step, reference, (q, seq) = split_fold_case("cuda", torch.bfloat16)
    for merge in (True, False):
        torch.testing.assert_close(step(merge).double(), reference(), rtol=2e-2, atol=2e-2)
    warmed, bare = torch.cuda.Stream(), torch.cuda.Stream()
    warmed.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmed):
        step(True)
    torch.cuda.synchronize()
    graphs, outs = [torch.cuda.CUDAGraph() for _ in range(2)], []
    for g, stream in zip(graphs, (warmed, bare), strict=True):
        with torch.cuda.graph(g, stream=stream):
            outs.append(step(True))
    for lens in ([1, 256, 30], [100, 3, 255], [256, 256, 256]):
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        with no_host_sync():
            for g in graphs:
                g.replay()
        for out in outs:
            torch.testing.assert_close(out.double(), reference(), rtol=2e-2, atol=2e-2)
    counters = triton_launch.SPLIT_COUNTERS
    assert not counters.buffers(q.device, bare.stream_id)  # its capture made none
    made = counters.buffers(q.device, warmed.stream_id)
    made += counters.buffers(q.device, torch.cuda.current_stream().stream_id)
    assert made and all(int(c.abs().sum()) == 0 for c in made)


def test_decode_config_carries_pdl_and_splits_wider_below_96_programs():
    for programs in (1, 64, 255, 256, 791, 792, 4096):
        for pdl in (False, True):
            assert launch_config.decode_config(programs, pdl).pdl is pdl
    assert not launch_config.decode_config(64).pdl  # off unless the caller knows the device has it
    # fewer programs: more splits per row; the split brackets take the rotary embedding in
    assert launch_config.decode_config(95).waves > launch_config.decode_config(96).waves == \
        launch_config.decode_config(791).waves > launch_config.decode_config(792).waves
    assert all(launch_config.decode_config(p).fuse_rope for p in (1, 31, 32, 95, 96, 791))
    assert not launch_config.decode_config(792).fuse_rope
    for p in (1, 95, 791):  # an fp8 cache: twice the keys per tile past six waves only
        assert launch_config.decode_config(p, kv_bytes=1) == launch_config.decode_config(p)
    assert launch_config.decode_config(792, kv_bytes=1).block_n == 2 * \
        launch_config.decode_config(792).block_n


@pytest.mark.parametrize("bad", [-1, 8, 256, 64.0, True])
def test_triton_config_refuses_a_register_cap_triton_cannot_take(bad):
    with pytest.raises(ValueError, match=rf"TritonConfig.max_registers: expected 0 .* got "
                                         rf"{bad!r}"):
        TritonConfig(max_registers=bad)
    assert TritonConfig(max_registers=80).max_registers == 80


@pytest.mark.cuda
def test_triton_pdl_is_refused_where_the_device_lacks_it(monkeypatch):

    kc, vc, bt, qsl, seq, q = decode_rows([5, 9], 2)
    monkeypatch.setattr(triton_launch, "has_pdl", lambda index: False)
    with pytest.raises(ValueError, match=r"TritonConfig.pdl = True needs programmatic "
                                         r"dependent launch"):
        triton_attention(q, kc, vc, qsl, seq, bt, 0.125, 1, 32, 0, 0.0, None,
                          config=TritonConfig(pdl=True))


def _decode_qkv_case(device, dtype, lens=(1, 37, 64, 13), h=8, hkv=2, d=32, bs=8, nblk=8,
                     seed=0, q_lens=None):
    """Rows at `lens` (the new tokens counted) of `q_lens` new tokens each (default one:
    decode rows) and two padded tokens: (qkv, positions, inv_freq, k_cache, v_cache,
    query_start_loc, seq_lens, block_table, slot_mapping), on `device`."""
    from graphattn.backends.rope import inv_frequencies

    g = torch.Generator().manual_seed(seed)
    rows = len(lens)
    seq = torch.tensor(lens, dtype=torch.int32)
    ql = torch.ones(rows, dtype=torch.int32) if q_lens is None else torch.tensor(
        q_lens, dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), ql.cumsum(0).int()])
    real = int(qsl[-1])
    t = real + 2
    kc, vc = (torch.randn(rows * nblk + 1, bs, hkv, d, generator=g).to(dtype)
              for _ in range(2))
    bt = torch.randperm(rows * nblk, generator=g).int().view(rows, nblk)
    row = torch.repeat_interleave(torch.arange(rows), ql)
    pos = torch.zeros(t, dtype=torch.int64)
    pos[:real] = (seq - ql)[row] + torch.arange(real) - qsl[:-1][row]
    slots = torch.full((t,), -1, dtype=torch.int64)
    slots[:real] = bt[row, pos[:real] // bs].long() * bs + pos[:real] % bs
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    return [x.to(device) for x in (qkv, pos, inv_frequencies(d, 1e4, "cpu"), kc, vc, qsl, seq,
                                   bt, slots)]


def rope_append(case, h, hkv):
    """The `Append` of `_decode_qkv_case`: its new K/V (views of qkv), slots and rotary."""
    qkv, pos, inv, *_, slots = case
    heads = qkv.view(qkv.shape[0], h + 2 * hkv, -1)
    return Append(heads[:, h:h + hkv], heads[:, h + hkv:], slots, pos, inv)


def _rotated_qkv(case, h, hkv):
    """qkv of `_decode_qkv_case` with q and k rotated as `_decode_qkv_reference` rotates them
    (rounded to the dtype): a model that applies its own rotary embedding."""
    qkv, pos = case[0], case[1].cpu()
    t, d = qkv.shape[0], case[3].shape[-1]
    x = qkv.double().cpu().view(t, h + 2 * hkv, d).clone()
    x[:, :h + hkv] = _rope_reference(x[:, :h + hkv], pos, 1e4)
    return x.view(t, -1).to(qkv.dtype).to(qkv.device)


def _decode_qkv_reference(case, h, hkv, window, softcap, sinks):
    """float64 output and caches of `_decode_qkv_case` (rotations rounded to the dtype)."""
    qkv, pos, _, kc, vc, qsl, seq, bt, slots = (x.cpu() for x in case)
    t, d, rows = qkv.shape[0], kc.shape[-1], bt.shape[0]
    real = int(qsl[-1])
    x = qkv.double().view(t, h + 2 * hkv, d)
    q = _rope_reference(x[:, :h], pos, 1e4).to(qkv.dtype).double()
    kc, vc = kc.double().clone(), vc.double().clone()
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    flat_k[slots[:real]] = _rope_reference(x[:real, h:h + hkv], pos[:real], 1e4) \
        .to(qkv.dtype).double()
    flat_v[slots[:real]] = x[:real, h + hkv:].to(qkv.dtype).double()
    sk = None if sinks is None else sinks.double().cpu()
    nd = rows if real == rows else 0
    out = gather_paged_attention(q, kc, vc, qsl, seq, bt, slots, d ** -0.5, nd, 1,
                                     bt.shape[1], window, softcap, sk)
    return out, kc, vc


def check_head_groups(device: str, dtype: torch.dtype, tol: float) -> None:
    """Programs that take 1 or 2 of a KV head's 4 query heads (`TritonConfig.head_tile`),
    launched under no_host_sync(), against the float64 reference: one-token rows with the
    fused rotary append (split and not), then the same caches read by uniform and mixed
    launches, one and two query tokens a row."""
    h, hkv = 8, 2
    case = _decode_qkv_case(device, dtype)
    qkv, pos, inv, kc, vc, qsl, seq, bt, slots = case
    ref, kref, vref = _decode_qkv_reference(case, h, hkv, 0, 0.0, None)
    q = qkv.view(qkv.shape[0], h + 2 * hkv, -1)[:, :h]
    rows, nblk = bt.shape
    for tile, waves in ((1, 0), (2, 64)):
        k2, v2 = kc.clone(), vc.clone()
        with no_host_sync():
            out = triton_attention(q, k2, v2, qsl, seq, bt, 32 ** -0.5, 1, 64, 0, 0.0, None,
                                   config=TritonConfig(block_n=16, waves=waves,
                                                       head_tile=tile),
                                   append=rope_append(case, h, hkv))
        torch.testing.assert_close(out[:rows].double().cpu(), ref[:rows], rtol=tol, atol=tol)
        assert out[rows:].abs().sum().item() == 0
        torch.testing.assert_close(k2.double().cpu(), kref, rtol=tol, atol=tol)
        torch.testing.assert_close(v2.double().cpu(), vref)
    q2 = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    want = gather_paged_attention(q2.double().cpu(), kc.double().cpu(), vc.double().cpu(),
                                  qsl.cpu(), seq.cpu(), bt.cpu(), slots.cpu(), 32 ** -0.5, 0,
                                  1, nblk, 0, 0.0, None)
    for uniform, tile in ((1, 2), (0, 1), (0, 2)):
        with no_host_sync():
            out = triton_attention(q2, kc, vc, qsl, seq, bt, 32 ** -0.5, uniform, 64, 0, 0.0,
                                   None, config=TritonConfig(block_n=16, head_tile=tile))
        torch.testing.assert_close(out[:rows].double().cpu(), want[:rows], rtol=tol, atol=tol)
    # two query tokens a row (a verify step), causal within the row
    q3 = torch.randn(2 * rows, h, q.shape[-1], generator=torch.Generator().manual_seed(2))
    qsl3 = torch.arange(0, 2 * rows + 1, 2, dtype=torch.int32)
    seq3 = seq.cpu().clamp(min=2)
    want = gather_paged_attention(q3.double(), kc.double().cpu(), vc.double().cpu(), qsl3,
                                  seq3, bt.cpu(), torch.zeros(2 * rows, dtype=torch.int64),
                                  32 ** -0.5, 0, 1, nblk, 0, 0.0, None)
    for uniform, tile in ((2, 1), (2, 2), (0, 2)):
        q3d, qsl3d, seq3d = q3.to(device, dtype), qsl3.to(device), seq3.to(device)
        with no_host_sync():
            out = triton_attention(q3d, kc, vc, qsl3d, seq3d, bt, 32 ** -0.5, uniform, 64, 0,
                                   0.0, None, config=TritonConfig(block_n=16, head_tile=tile))
        torch.testing.assert_close(out.double().cpu(), want, rtol=tol, atol=tol)


@pytest.mark.cuda
def test_head_groups_match_the_reference_on_cuda():
    check_head_groups("cuda", torch.bfloat16, 3e-2)


def test_head_tile_splits_only_what_does_not_fit():
    from graphattn.backends.launch_config import head_tile

    assert head_tile(4, 1, 64) == 4 and head_tile(8, 4, 128) == 8  # ordinary GQA: whole
    assert head_tile(128, 1, 1024) == 16 and head_tile(128, 2, 1024) == 8  # MLA's latent
    assert head_tile(12, 1, 4096) == 4  # the largest power of two dividing the group
    assert head_tile(8, 1, 64, requested=2) == 2
    with pytest.raises(ValueError, match="head_tile = 3 must divide"):
        head_tile(8, 1, 64, requested=3)


@pytest.mark.cuda
def test_mla_latent_decode_runs_in_head_groups_on_cuda():
    """DeepSeek-V3's absorbed decode: 128 query heads over one 576-wide latent head whose
    first 512 dims are the values; needs head groups to fit the shared memory."""
    torch.manual_seed(0)
    rows, h, d, dv, bs, nblk = 3, 128, 576, 512, 64, 4
    cache = torch.randn(rows * nblk + 1, bs, 1, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.arange(rows * nblk, device="cuda", dtype=torch.int32).view(rows, nblk)
    qsl = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    seq = torch.tensor([5, 200, 256], device="cuda", dtype=torch.int32)
    q = torch.randn(rows, h, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.zeros(rows, dtype=torch.int64, device="cuda")
    want = gather_paged_attention(q.double(), cache.double(), cache[..., :dv].double(), qsl,
                                  seq, bt, slots, d ** -0.5, 0, 1, nblk, 0, 0.0, None)
    with no_host_sync():
        out = triton_attention(q, cache, cache[..., :dv], qsl, seq, bt, d ** -0.5, 1,
                               nblk * bs, 0, 0.0, None)
    torch.testing.assert_close(out.double(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize(("device", "dtype", "split", "tol"), [
    ("cpu", torch.float32, True, 1e-4),
    pytest.param("cuda", torch.float32, True, 2e-3, marks=pytest.mark.cuda),
    pytest.param("cuda", torch.bfloat16, True, 2e-2, marks=pytest.mark.cuda),
    pytest.param("cuda", torch.bfloat16, False, 2e-2, marks=pytest.mark.cuda)])
@pytest.mark.parametrize("q_lens", [None, (1, 5, 3, 2)], ids=["decode", "mixed"])
@pytest.mark.parametrize("rotated", [False, True], ids=["rope", "rotated"])
def test_rope_paged_attention_matches_float64_reference(feature, device, dtype, split, tol,
                                                        q_lens, rotated, monkeypatch):
    """Rotation, the K/V write and attention in one op: one-token decode rows (one Triton
    launch + merge on CUDA, split or not) and mixed rows (the write, then attention):
    output, written slots and untouched slots against float64; on CUDA again from a
    captured graph replayed at new device lengths. `rotated`: q and k come rotated, through
    `append_paged_attention` (the write and attention alone), against the same reference."""
    if not split:
        monkeypatch.setattr(triton_launch, "decode_config",
                            lambda programs, pdl=False, kv_bytes=2: TritonConfig(
                                block_n=16, waves=0, pdl=pdl))
    h, hkv, nblk, bs = 8, 2, 8, 8
    feats = dict(FEATURES[feature])
    window, softcap = feats.get("window", 0), feats.get("softcap", 0.0)
    sinks = (torch.randn(h) * 2).to(device, dtype) if feats.get("sinks") else None

    def run(case, heads=None):
        rows = case[7].shape[0]
        tail = (32 ** -0.5, 0 if q_lens else rows, 1, kv_bounds(nblk, nblk * bs), window,
                softcap, sinks, "auto")
        with no_host_sync():
            if rotated:  # q and k come rotated (`heads`): the write and attention alone
                return torch.ops.graphattn.append_paged_attention(
                    heads[:, :h], heads[:, h:h + hkv], heads[:, h + hkv:], *case[3:], *tail)
            return torch.ops.graphattn.rope_paged_attention(
                *case, tail[0], h, hkv, *tail[1:])

    def rotated_heads(case):  # built outside no_host_sync: the float64 rotation is on CPU
        return _rotated_qkv(case, h, hkv).view(case[0].shape[0], h + 2 * hkv, -1)

    def check(case, out, before):
        ref, kref, vref = _decode_qkv_reference([*case[:3], *before, *case[5:]], h, hkv,
                                                window, softcap, sinks)
        t = int(case[5][-1])
        torch.testing.assert_close(out[:t].double().cpu(), ref[:t], rtol=tol, atol=tol)
        assert out[t:].abs().sum().item() == 0  # padded tokens
        kept = slice(0, -bs)  # the torch path parks padded tokens in the sink block
        for got, want in ((case[3], kref), (case[4], vref)):
            torch.testing.assert_close(got.double().cpu()[kept], want[kept], rtol=tol, atol=tol)

    case = _decode_qkv_case(device, dtype, q_lens=q_lens)
    before = [case[3].clone(), case[4].clone()]
    heads = rotated_heads(case) if rotated else None
    check(case, run(case, heads), before)
    if device != "cuda":
        return
    new = _decode_qkv_case(device, dtype, lens=(64, 9, 20, 50), seed=1, q_lens=q_lens)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(case, heads)
    for x, y in zip(case, new, strict=True):
        x.copy_(y)
    if rotated:
        heads.copy_(rotated_heads(case))
    before = [case[3].clone(), case[4].clone()]
    with no_host_sync():
        graph.replay()
    check(case, out, before)


@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_rope_paged_attention_agrees_with_its_fake_and_refuses_bad_input_unchanged(device):
    case = _decode_qkv_case(device, torch.float32)
    h, hkv, bounds, rows = 8, 2, kv_bounds(8, 64), case[7].shape[0]
    tail = (0.2, h, hkv, rows, 1, bounds, 0, 0.0, None, "auto")
    op = torch.ops.graphattn.rope_paged_attention
    if device == "meta":
        out = op(*case, *tail)
        assert out.shape == (case[0].shape[0], h, 32) and out.device.type == "meta"
        return
    torch.library.opcheck(op.default, (*case, *tail))
    before = [case[3].clone(), case[4].clone()]
    with pytest.raises(ValueError, match=r"qkv has shape \(6, 384\), expected \(6, 448\)"):
        op(*case, 0.2, h + 2, hkv, rows, 1, bounds, 0, 0.0, None, "auto")
    with pytest.raises(ValueError, match="kv_bounds must be an int64 CPU tensor"):
        op(*case, 0.2, h, hkv, rows, 1, bounds.to(device).float()[None], 0, 0.0, None, "auto")
    with pytest.raises(ValueError, match=r"qkv has 3 tokens, expected >= 4 \(num_decodes = 4 "
                                         r"x decode_query_len = 1\)"):
        op(case[0][:3], *case[1:], *tail)
    assert torch.equal(case[3], before[0]) and torch.equal(case[4], before[1])
    qkv, pos, inv, kc, vc, qsl, seq, bt, slots = case
    q = qkv.view(qkv.shape[0], h + 2 * hkv, 32)[:, :h]
    with pytest.raises(ValueError, match="fused K/V append takes one-token rows and a "
                                         "power-of-two head_dim >= 16 for K and V; got query "
                                         "length 2, head_dim 32, V head_dim 32"):
        triton_attention(q, kc, vc, qsl, seq, bt, 0.2, 2, 64, 0, 0.0, None,
                         append=rope_append(case, h, hkv))


@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_append_paged_attention_agrees_with_its_fake_and_refuses_bad_input_unchanged(device):
    case = _decode_qkv_case(device, torch.float32)
    h, hkv, rows = 8, 2, case[7].shape[0]
    heads = case[0].view(case[0].shape[0], h + 2 * hkv, 32)
    q, k, v = heads[:, :h], heads[:, h:h + hkv], heads[:, h + hkv:]
    tail = (0.2, rows, 1, kv_bounds(8, 64), 0, 0.0, None, "auto")
    op = torch.ops.graphattn.append_paged_attention
    if device == "meta":
        out = op(q, k, v, *case[3:], *tail)
        assert out.shape == (q.shape[0], h, 32) and out.device.type == "meta"
        return
    torch.library.opcheck(op.default, (q, k, v, *case[3:], *tail))
    before = [case[3].clone(), case[4].clone()]
    with pytest.raises(ValueError, match=r"v has shape \(6, 1, 32\), expected \(6, 2, 32\) "
                                         r"\(q's tokens, the v cache's heads and head_dim\)"):
        op(q, k, v[:, :1], *case[3:], *tail)
    with pytest.raises(ValueError, match=r"q has 3 tokens, expected >= 4 \(num_decodes = 4 "
                                         r"x decode_query_len = 1\)"):
        op(q[:3], k[:3], v[:3], *case[3:], *tail)
    with pytest.raises(ValueError, match="kv_bounds must be an int64 CPU tensor"):
        op(q, k, v, *case[3:], *tail[:3], kv_bounds(8, 64).to(device).float()[None],
           *tail[4:])
    assert torch.equal(case[3], before[0]) and torch.equal(case[4], before[1])


def test_fuse_rope_decode_where_few_programs_split_the_kv_axis(monkeypatch):
    """The fused decode only for split launches of the brackets `decode_config` marks (the
    1b model's shapes on a 132-multiprocessor GPU: 64 rows x 8 KV heads fill two waves
    unsplit); the op runs the two ops elsewhere, so the CPU always takes it."""
    cpu = torch.device("cpu")
    assert launch_config.fuse_rope_decode(128, 8, 64, 2048, cpu)
    monkeypatch.setattr(launch_config, "resolve_kernel", lambda kernel, device: "triton")
    monkeypatch.setattr(launch_config, "num_sms", lambda device: 132)
    picks = {rows: launch_config.fuse_rope_decode(rows, 8, 64, 702, cpu)
             for rows in (1, 8, 32, 64, 128)}
    assert picks == {1: True, 8: True, 32: True, 64: False, 128: False}
