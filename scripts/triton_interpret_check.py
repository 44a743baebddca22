"""Check the Triton kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1).

    TRITON_INTERPRET=1 python scripts/triton_interpret_check.py

Compares `_triton_attention`, `write_kv_kernel` and `rope_write_kv_kernel` with the plain-
torch reference on random paged batches (mixed, uniform decode with split-KV, spec-decode
rows, window/softcap/sinks).
A development aid before spending GPU time; the GPU tests are the real check. (Triton
3.6's interpreter calls int() on 1-element arrays, which numpy >= 2.4 refuses: use an older
numpy, or patch its `__index__` to take the first element.)
"""

import os

import numpy as np
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

from graphattn.backends import ops  # noqa: E402

ops._num_sms = lambda device: 8


def case(rows, qlens, ctx, h, hkv, d, bs, window=0, softcap=0.0, sinks=False, uniform=0,
         dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    qlens = np.asarray(qlens)
    seq = np.asarray(ctx) + qlens
    t_real = int(qlens.sum())
    t = t_real + 3
    rows_p = rows + 1
    nblk = int(-(-seq.max() // bs)) + 1
    kc = torch.randn(rows_p * nblk + 1, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(rows_p * nblk + 1, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(rows_p * nblk, generator=g).int().view(rows_p, nblk)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(qlens), [t_real]]), dtype=torch.int32)
    sl = torch.tensor(np.append(seq, 0), dtype=torch.int32)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    slots = torch.full((t,), -1, dtype=torch.int64)
    sk = torch.randn(h, generator=g) if sinks else None
    max_len = int(seq.max())
    nd = rows_p if uniform else 0
    ref = ops.gather_paged_attention(q.double(), kc.double(), vc.double(), qsl, sl, perm,
                                     torch.zeros(t, dtype=torch.int64), d ** -0.5, nd,
                                     uniform or 1, nblk, window, softcap,
                                     None if sk is None else sk.double())
    torch.full((t * h * d,), float("nan"), dtype=dtype)  # the output is never pre-filled
    out = ops._triton_attention(q, kc, vc, qsl, sl, perm, d ** -0.5, uniform, max_len, window,
                                softcap, sk)
    err = (out.double()[:t_real] - ref[:t_real]).abs().max().item()
    assert out[t_real:].abs().max().item() == 0
    print(f"rows={rows} q={qlens.tolist()} h={h}/{hkv} d={d} win={window} cap={softcap} "
          f"sinks={sinks} uniform={uniform}: max err {err:.2e}")
    assert err < 1e-4, err
    del slots


case(3, [1, 5, 20], [7, 0, 33], 4, 2, 16, 8)
case(3, [1, 5, 20], [7, 0, 33], 4, 2, 16, 8, window=6, softcap=3.0, sinks=True)
case(4, [1, 1, 1, 1], [100, 3, 250, 64], 8, 2, 32, 16, uniform=1)
case(4, [1, 1, 1, 1], [100, 3, 250, 64], 8, 2, 32, 16, uniform=1, sinks=True, softcap=2.0,
     window=40)
case(2, [3, 3], [40, 90], 4, 1, 16, 8, uniform=3)
case(2, [2, 9], [0, 12], 6, 3, 24, 4)
case(1, [1], [700], 4, 1, 16, 16, uniform=1, sinks=True)  # 8 splits, some empty
case(2, [1, 2], [40, 70], 2, 1, 600, 16)  # wide heads (an MLA-like width)

# write kernel
from graphattn.backends.triton_kernels import write_kv_kernel  # noqa: E402

k = torch.randn(5, 2, 16)
v = torch.randn(5, 2, 16)
kc = torch.zeros(9, 4, 2, 16)
vc = torch.zeros(9, 4, 2, 16)
slots = torch.tensor([3, -1, 17, 0, 30])
write_kv_kernel[(5,)](k, v, kc, vc, slots, k.stride(0), v.stride(0), kc.stride(1), vc.stride(1),
                      ROW_K=32, ROW_V=32, BLOCK=32)
flat = kc.view(-1, 2, 16)
ok = slots >= 0
assert torch.equal(flat[slots[ok]], k[ok]) and (flat != 0).sum() == (k[ok] != 0).sum()
print("write_kv ok")

# rope + write kernel against the plain-torch path of the same op
from graphattn.backends.rope import inv_frequencies  # noqa: E402
from graphattn.backends.triton_kernels import rope_write_kv_kernel  # noqa: E402

for h, hkv, d in [(4, 2, 16), (6, 2, 24)]:
    t = 5
    qkv = torch.randn(t, (h + 2 * hkv) * d)
    pos = torch.tensor([0, 7, 130, 2047, 3])
    inv = inv_frequencies(d, 10000.0)
    slots = torch.tensor([3, -1, 17, 0, 30])
    caches = [torch.zeros(9, 4, hkv, d) for _ in range(4)]
    q_ref = torch.ops.graphattn.rope_write_kv(qkv, pos, inv, caches[0], caches[1], slots, h,
                                              hkv, "torch")
    q = torch.empty(t, h, d)
    rope_write_kv_kernel[(t,)](qkv, pos, inv, q, caches[2], caches[3], slots, qkv.stride(0),
                               q.stride(0), caches[2].stride(1), caches[3].stride(1), H=h,
                               HKV=hkv, D=d, H_PAD=ops._pow2(h), HKV_PAD=ops._pow2(hkv),
                               HALF_PAD=max(2, ops._pow2(d // 2)), D_PAD=max(2, ops._pow2(d)))
    ok = slots >= 0
    for got, ref in ((q, q_ref), (caches[2].view(-1, hkv, d)[slots[ok]],
                                  caches[0].view(-1, hkv, d)[slots[ok]]),
                     (caches[3].view(-1, hkv, d)[slots[ok]],
                      caches[1].view(-1, hkv, d)[slots[ok]])):
        err = (got - ref).abs().max().item()
        assert err < 1e-5, err
    assert caches[2][:-1].count_nonzero() == caches[0][:-1].count_nonzero()  # -1: no write
    print(f"rope_write_kv h={h}/{hkv} d={d} ok")
