"""Small-M linear layers (decode projections) as a Triton GEMV.

At batch 1 a decode step is a chain of matrix-vector products whose weights are read
once: the time is the weight bytes over the bandwidth plus each kernel's ramp and tail.
``torch.ops.graphattn.small_m_linear`` computes ``x @ weight.T`` for up to `MAX_M` rows
with one program per `block_n` output features (every program streams its weight rows
once, in `block_k` tiles). With programmatic dependent launch (`GemvConfig.pdl`, off by
default: measured slower) its first weight tile is loaded before the wait for the previous
kernel, since weights never depend on it. The plain `torch.nn.functional.linear` is the
reference and the CPU path; `bench.small_m_linear` times both on a 1B's projections (on an
H100 cuBLAS was faster: the results page), so models use it only through `swap_linears`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from graphattn.backends.launch_config import device_index, has_pdl, has_triton, num_sms, pow2

__all__ = ["GEMV_PIPELINE_BYTES", "MAX_M", "GemvConfig", "GemvPrologue", "SmallMLinear",
           "add_norm_linear", "gemv_config", "gemv_stages", "norm_linear", "small_m_linear",
           "swap_linears", "use_small_m_linear"]

MAX_M = 16
# shared memory the GEMV's pipelined weight tiles may take: two programs fit an H100's
# 228 KB per multiprocessor
GEMV_PIPELINE_BYTES = 98304


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Launch parameters of `small_m_linear_kernel`.

    Attributes
    ----------
    block_n, block_k : int
        Output features per program and weight columns per tile (powers of two).
    num_warps : int
    num_stages : int
        Weight tiles in flight in the loop's software pipeline (`gemv_stages` lowers it
        where the tiles would not fit the shared memory).
    pdl : bool
        Programmatic dependent launch (the first weight tile loaded before the wait).
    """

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    pdl: bool = False


def gemv_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    """The default config for an [m, k] x [n, k]^T product. One row: 8 outputs a program,
    1,024-wide K tiles (the fastest of 36 configs for each 1B projection in
    `bench.small_m_linear --sweep --rows 1`, H100). More rows: the largest `block_n` (16
    down to tl.dot's floor) that still gives two programs per multiprocessor. PDL stays
    off: in `bench.small_m_linear` (H100) the chain ran slower with it."""
    if m == 1:
        return GemvConfig(block_n=8, block_k=min(1024, max(64, pow2(k) // 2)))
    floor, block_n = 16, 16
    sms = num_sms(device) if device.type == "cuda" else 132
    while block_n > floor and -(-n // block_n) < 2 * sms:
        block_n //= 2
    return GemvConfig(block_n=block_n, block_k=min(512, max(64, pow2(k) // 4)))


def gemv_stages(cfg: GemvConfig, element_size: int, glu: bool) -> int:
    """Weight tiles the GEMV's loop keeps in flight: `cfg.num_stages`, fewer where they
    would take more than `GEMV_PIPELINE_BYTES` of shared memory (two tiles a stage with
    `glu`), at least 1 (no pipeline)."""
    stage = cfg.block_n * cfg.block_k * element_size * (2 if glu else 1)
    return max(1, min(cfg.num_stages, GEMV_PIPELINE_BYTES // stage))


def use_small_m_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `small_m_linear` runs the Triton kernel for these operands (CPU numbers:
    the device, the row count and the dtypes)."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_M and has_triton()
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16,
                                                         torch.float32)
            and weight.stride(-1) == 1 and x.stride(-1) == 1)


@torch.library.custom_op("graphattn::small_m_linear", mutates_args=())
def small_m_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for few rows.

    Parameters
    ----------
    x : [M, K]; weight : [N, K], same dtype.

    Returns
    -------
    torch.Tensor
        [M, N] in x's dtype, accumulated in float32. The Triton kernel where
        `use_small_m_linear` holds, else ``torch.nn.functional.linear``.
    """
    if not use_small_m_linear(x, weight):
        return torch.nn.functional.linear(x, weight)
    return launch_small_m_linear(x, weight)


@small_m_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@dataclass(frozen=True, slots=True)
class GemvPrologue:
    """What `small_m_linear_kernel` does to its input rows before the product.

    Attributes
    ----------
    delta : [M, K], optional
        Added to x first (a residual stream's pending update).
    h_out : [M, K], optional (with `delta`)
        Receives x + delta, rounded to x's dtype (the next residual stream).
    gamma : [K], optional
        RMSNorm of the (summed) rows with this weight and `eps`, in float32.
    eps : float
    glu : bool
        The weight holds 2 N rows, gate then up; the output is silu(gate) * up [M, N].
    """

    delta: torch.Tensor | None = None
    h_out: torch.Tensor | None = None
    gamma: torch.Tensor | None = None
    eps: float = 0.0
    glu: bool = False


def _norm_linear_torch(h: torch.Tensor, gamma: torch.Tensor, eps: float, weight: torch.Tensor,
                       glu: bool) -> torch.Tensor:
    y = nn.functional.linear(nn.functional.rms_norm(h, (h.shape[-1],), gamma, eps), weight)
    if glu:
        g, u = y.chunk(2, -1)
        y = nn.functional.silu(g) * u
    return y


def _check_norm_linear(x: torch.Tensor, gamma: torch.Tensor, weight: torch.Tensor,
                       glu: bool) -> None:
    k = x.shape[-1]
    if x.dim() != 2 or tuple(gamma.shape) != (k,) or weight.dim() != 2 or \
            weight.shape[1] != k or (glu and weight.shape[0] % 2):
        raise ValueError(f"x [M, K], gamma [K] and weight [N, K] ([2 N, K] with glu) "
                         f"expected; got x {list(x.shape)}, gamma {list(gamma.shape)}, "
                         f"weight {list(weight.shape)}, glu {glu}")


@torch.library.custom_op("graphattn::norm_linear", mutates_args=())
def norm_linear(x: torch.Tensor, gamma: torch.Tensor, eps: float, weight: torch.Tensor,
                glu: bool) -> torch.Tensor:
    """``linear(rms_norm(x, gamma, eps), weight)`` for few rows, one launch on CUDA.

    Parameters
    ----------
    x : [M, K]; gamma : [K]; weight : [N, K], or [2 N, K] (gate rows, then up) with `glu`
    eps : float
    glu : bool
        Return silu(gate) * up [M, N] (a gated MLP's activation) instead of the product.

    Returns
    -------
    torch.Tensor
        [M, N] in x's dtype: the Triton GEMV where `use_small_m_linear` holds (the norm in
        its prologue: every program normalizes the rows itself), else plain torch.
    """
    _check_norm_linear(x, gamma, weight, glu)
    if not use_small_m_linear(x, weight):
        return _norm_linear_torch(x, gamma, eps, weight, glu)
    return launch_small_m_linear(x, weight, prologue=GemvPrologue(gamma=gamma, eps=eps,
                                                                  glu=glu))


@norm_linear.register_fake
def _(x, gamma, eps, weight, glu):
    return x.new_empty(x.shape[0], weight.shape[0] // (2 if glu else 1))


@torch.library.custom_op("graphattn::add_norm_linear", mutates_args=())
def add_norm_linear(x: torch.Tensor, delta: torch.Tensor, gamma: torch.Tensor, eps: float,
                    weight: torch.Tensor, glu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + delta`` and ``norm_linear(h, gamma, eps, weight, glu)`` in one launch on
    CUDA: a residual add, the next norm and the projection after it.

    Parameters
    ----------
    x, delta : [M, K]
        The residual stream and its pending update, same dtype.
    gamma, eps, weight, glu
        As in `norm_linear`.

    Returns
    -------
    (h [M, K], y [M, N])
        h rounded to x's dtype (the next residual stream), y as `norm_linear`'s.
    """
    _check_norm_linear(x, gamma, weight, glu)
    if tuple(delta.shape) != tuple(x.shape) or delta.dtype != x.dtype:
        raise ValueError(f"delta must match x: got {list(delta.shape)} {delta.dtype}, x "
                         f"{list(x.shape)} {x.dtype}")
    if not use_small_m_linear(x, weight) or delta.stride(-1) != 1:
        h = x + delta
        return h, _norm_linear_torch(h, gamma, eps, weight, glu)
    h = torch.empty_like(x, memory_format=torch.contiguous_format)
    y = launch_small_m_linear(x, weight, prologue=GemvPrologue(delta, h, gamma, eps, glu))
    return h, y


@add_norm_linear.register_fake
def _(x, delta, gamma, eps, weight, glu):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(x.shape[0], weight.shape[0] // (2 if glu else 1)))


def launch_small_m_linear(x: torch.Tensor, weight: torch.Tensor,
                          config: GemvConfig | None = None,
                          prologue: GemvPrologue = GemvPrologue()) -> torch.Tensor:
    """`small_m_linear_kernel` over ceil(N / block_n) programs; returns [M, N] (N: the
    weight's rows, half of them with `prologue.glu`)."""
    from graphattn.backends.triton_kernels import small_m_linear_kernel

    (m, k), n = x.shape, weight.shape[0] // (2 if prologue.glu else 1)
    if weight.shape[1] != k:
        raise ValueError(f"weight: expected [N, {k}] for x [{m}, {k}], got "
                         f"{list(weight.shape)}")
    cfg = config or gemv_config(m, n, k, x.device)
    if cfg.pdl and not (x.is_cuda and has_pdl(device_index(x.device))):
        raise ValueError(f"GemvConfig.pdl = True needs programmatic dependent launch "
                         f"(compute capability >= 9, a Triton with gdc_wait); {x.device} "
                         f"lacks it")
    y = x.new_empty(m, n)
    delta, h_out = prologue.delta, prologue.h_out
    small_m_linear_kernel[(-(-n // cfg.block_n),)](
        x, weight, y, x if delta is None else delta,
        x if prologue.gamma is None else prologue.gamma, x if h_out is None else h_out, m, n,
        prologue.eps, x.stride(0), weight.stride(0), y.stride(0),
        0 if delta is None else delta.stride(0), 0 if h_out is None else h_out.stride(0), K=k,
        M_PAD=max(16, pow2(m)) if m > 1 else 1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        USE_PDL=cfg.pdl, IEEE=x.dtype == torch.float32, ADD=delta is not None,
        NORM=prologue.gamma is not None, GLU=prologue.glu,
        STAGES=gemv_stages(cfg, weight.element_size(), prologue.glu), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=cfg.pdl)
    return y


class SmallMLinear(nn.Linear):
    """An `nn.Linear` whose products of up to `MAX_M` rows (leading dims flattened) run
    ``torch.ops.graphattn.small_m_linear``; the choice is made from the shape, so inside a
    captured or compiled step it is fixed per batch shape. Made by `swap_linears`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if not use_small_m_linear(flat, self.weight):
            return nn.functional.linear(x, self.weight, self.bias)
        y = torch.ops.graphattn.small_m_linear(flat, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def swap_linears(model: nn.Module, enabled: bool = True,
                 only: Callable[[nn.Linear], bool] | None = None) -> int:
    """Turn the plain `nn.Linear` layers of `model` into `SmallMLinear` in place (same
    weights, same module objects), or back with ``enabled=False``; returns how many
    changed. Call it before the runner captures or compiles.

    Parameters
    ----------
    only : callable, optional
        Takes a layer, says whether to change it (e.g. ``lambda m: m.in_features >= 8192``
        for the shapes the GEMV wins on, `bench.small_m_linear`'s per-shape rows); default
        every layer.
    """
    old, new = (nn.Linear, SmallMLinear) if enabled else (SmallMLinear, nn.Linear)
    changed = 0
    for module in model.modules():
        if type(module) is old and (only is None or only(module)):
            module.__class__ = new
            changed += 1
    return changed
