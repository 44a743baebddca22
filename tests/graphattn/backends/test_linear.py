"""The small-M linear op: the Triton GEMV against a float64 product (GPU, and the
interpreter in test_triton_interpreter), the torch fallback elsewhere, meta shapes, no host
sync, and capture in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from graphattn.backends.linear import (
    GEMV_PIPELINE_BYTES,
    MAX_M,
    GemvConfig,
    GemvPrologue,
    SmallMLinear,
    gemv_config,
    gemv_stages,
    launch_small_m_linear,
    swap_linears,
    use_small_m_linear,
)
from graphattn.sync import no_host_sync

SHAPES = ((1, 40, 96), (3, 72, 300), (16, 40, 96), (MAX_M, 2048, 520))
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def check_gemv(device: str, dtype: torch.dtype, launch=launch_small_m_linear,
               shapes=SHAPES) -> None:
    """`launch(x, w)` against x @ w.T in float64 on fresh random operands; the tolerance is
    relative to the largest output."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in shapes:
        x = torch.randn(m, k, generator=g, dtype=torch.float64)
        w = torch.randn(n, k, generator=g, dtype=torch.float64)
        want = x @ w.T
        got = launch(x.to(device, dtype), w.to(device, dtype)).double().cpu()
        assert got.shape == (m, n)
        err = float((got - want).abs().max() / want.abs().max())
        assert err < TOL[dtype], (m, n, k, dtype, err)


def _norm_linear_reference(x, delta, gamma, eps, w, glu):
    """float64 (h, y) of `add_norm_linear` (delta None: `norm_linear`'s, h = x)."""
    h = x.double() if delta is None else x.double() + delta.double()
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * gamma.double()
    y = n @ w.double().T
    if glu:
        g, u = y.chunk(2, -1)
        y = torch.nn.functional.silu(g) * u
    return h, y


def check_fused_gemv(device: str, dtype: torch.dtype, fused=None, shapes=SHAPES) -> None:
    """`fused(x, delta, gamma, eps, w, glu) -> (h, y)` (default: the Triton launch with its
    prologue) against float64, with and without the residual add and the gated epilogue, on
    fresh random operands; h must equal x + delta rounded to `dtype`."""
    def launch(x, delta, gamma, eps, w, glu):
        h = None if delta is None else torch.empty_like(x)
        y = launch_small_m_linear(x, w, prologue=GemvPrologue(delta, h, gamma, eps, glu))
        return (x if h is None else h), y

    g = torch.Generator().manual_seed(1)
    for m, n, k in shapes:
        for add, glu in ((False, False), (True, False), (True, True)):
            x, delta = (torch.randn(m, k, generator=g, dtype=torch.float64) for _ in range(2))
            gamma = 1 + torch.rand(k, generator=g, dtype=torch.float64)
            w = torch.randn(2 * n if glu else n, k, generator=g, dtype=torch.float64)
            args = [t.to(device, dtype) for t in (x, delta, gamma, w)]
            h, y = (fused or launch)(args[0], args[1] if add else None, args[2], 1e-5,
                                     args[3], glu)
            want_h, want = _norm_linear_reference(*args[:1], args[1] if add else None,
                                                  args[2], 1e-5, args[3], glu)
            torch.testing.assert_close(h.double().cpu(), (args[0] + args[1] if add
                                                          else args[0]).double().cpu())
            err = float((y.double().cpu() - want.cpu()).abs().max() / want.abs().max())
            assert y.shape == (m, n) and err < TOL[dtype], (m, n, k, add, glu, dtype, err)


def _fused_ops(x, delta, gamma, eps, w, glu):
    with no_host_sync():
        if delta is None:
            return x, torch.ops.graphattn.norm_linear(x, gamma, eps, w, glu)
        return torch.ops.graphattn.add_norm_linear(x, delta, gamma, eps, w, glu)


def test_norm_linear_ops_match_float64_on_cpu_and_their_fakes():
    """`norm_linear` / `add_norm_linear` (the plain-torch path on CPU) against float64, meta
    shapes, and refusals naming the shapes."""
    check_fused_gemv("cpu", torch.float32, _fused_ops)
    x, w, g = (torch.empty(*s, device="meta") for s in ((3, 64), (80, 64), (64,)))
    assert torch.ops.graphattn.norm_linear(x, g, 1e-5, w, True).shape == (3, 40)
    h, y = torch.ops.graphattn.add_norm_linear(x, x, g, 1e-5, w, False)
    assert h.shape == (3, 64) and y.shape == (3, 80)
    torch.library.opcheck(torch.ops.graphattn.add_norm_linear.default,
                          (torch.randn(2, 8), torch.randn(2, 8), torch.rand(8), 1e-5,
                           torch.randn(6, 8), True))
    with pytest.raises(ValueError, match=r"got x \[2, 8\], gamma \[4\], weight \[6, 8\]"):
        torch.ops.graphattn.norm_linear(torch.randn(2, 8), torch.rand(4), 1e-5,
                                        torch.randn(6, 8), False)
    with pytest.raises(ValueError, match=r"delta must match x: got \[1, 8\]"):
        torch.ops.graphattn.add_norm_linear(torch.randn(2, 8), torch.randn(1, 8),
                                            torch.rand(8), 1e-5, torch.randn(6, 8), False)


def _unsynced(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with no_host_sync():
        return torch.ops.graphattn.small_m_linear(x, w)


def test_cpu_runs_the_torch_product_under_no_host_sync():
    check_gemv("cpu", torch.float32, _unsynced)


def test_meta_shapes():
    x = torch.empty(3, 64, device="meta")
    w = torch.empty(40, 64, device="meta")
    assert torch.ops.graphattn.small_m_linear(x, w).shape == (3, 40)


def test_kernel_choice_from_cpu_numbers():
    w = torch.empty(8, 4)
    assert not use_small_m_linear(torch.empty(1, 4), w)  # CPU
    for n, k in ((16384, 2048), (2048, 8192), (128256, 2048)):  # one row: the sweep's best
        assert gemv_config(1, n, k, torch.device("cpu")) == GemvConfig(block_n=8, block_k=1024)
    assert gemv_config(1, 64, 256, torch.device("cpu")).block_k == 128
    assert gemv_config(4, 2048, 8192, torch.device("cpu")).block_n == 16  # tl.dot's floor
    # the loop's pipeline: the config's stages while their tiles fit GEMV_PIPELINE_BYTES
    cfg = GemvConfig(block_n=16, block_k=512, num_stages=3)
    assert gemv_stages(cfg, 2, glu=False) == 3 and gemv_stages(cfg, 2, glu=True) == 3
    assert gemv_stages(cfg, 4, glu=True) == GEMV_PIPELINE_BYTES // (16 * 512 * 4 * 2) == 1
    assert gemv_stages(GemvConfig(block_n=64, block_k=1024), 4, glu=True) == 1


def test_swap_linears_keeps_the_modules_and_their_outputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4, bias=False))
    x = torch.randn(2, 3, 8)
    want = model(x)
    first = model[0]
    assert swap_linears(model) == 2 and isinstance(model[0], SmallMLinear)
    assert model[0] is first
    torch.testing.assert_close(model(x), want)
    assert swap_linears(model, enabled=False) == 2 and type(model[0]) is torch.nn.Linear
    assert swap_linears(model, only=lambda m: m.in_features == 16) == 1
    assert type(model[0]) is torch.nn.Linear and isinstance(model[2], SmallMLinear)


def test_mismatched_weight_and_pdl_without_a_gpu_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"weight: expected \[N, 64\]"):
        launch_small_m_linear(torch.empty(1, 64), torch.empty(8, 32))
    with pytest.raises(ValueError, match=r"GemvConfig.pdl = True needs"):
        launch_small_m_linear(torch.empty(1, 64), torch.empty(8, 64), GemvConfig(pdl=True))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gemv_matches_float64_and_replays_in_a_graph(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(1, 96, device="cuda", dtype=dtype)
    assert use_small_m_linear(x, torch.empty(8, 96, device="cuda", dtype=dtype))
    check_gemv("cuda", dtype, _unsynced)
    for cfg in (GemvConfig(block_n=8), GemvConfig(block_n=32, block_k=64, num_warps=8)):
        check_gemv("cuda", dtype, lambda a, b, c=cfg: launch_small_m_linear(a, b, c),
                   shapes=((1, 40, 96), (1, 72, 300)))
    w = torch.randn(300, 96, device="cuda", dtype=dtype)
    want = torch.ops.graphattn.small_m_linear(x, w)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with no_host_sync(), torch.cuda.graph(graph):
            y = torch.ops.graphattn.small_m_linear(x, w)
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(y, want)
    check_fused_gemv("cuda", dtype)
    check_fused_gemv("cuda", dtype, _fused_ops, shapes=((1, 40, 96), (4, 72, 300)))
    layer = torch.nn.Linear(96, 300, device="cuda", dtype=dtype)
    ref = layer(x[None])
    swap_linears(layer)
    torch.testing.assert_close(layer(x[None]), ref, rtol=TOL[dtype], atol=TOL[dtype])
