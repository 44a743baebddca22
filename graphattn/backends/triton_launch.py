"""Launches of the Triton kernels (`graphattn.backends.triton_kernels`, imported on first
use): grid, tiles and constexprs from CPU numbers only, never a host read of device data."""

from __future__ import annotations

import torch

from graphattn.backends.launch_config import (
    PREFILL_CONFIG,
    TritonConfig,
    decode_config,
    device_index,
    has_pdl,
    num_sms,
    pow2,
    rope_fusable,
    tiles,
)
from graphattn.backends.reference import is_fp8

__all__ = ["check_contiguous_caches", "launch_rope_write_kv", "launch_write_kv",
           "launch_shared_prefix", "merge_shared_prefix", "triton_attention"]


def check_contiguous_caches(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError unless both caches are contiguous (the Triton kernels address slots by
    one stride)."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op} with kernel 'triton' needs contiguous caches")


def _attention_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: int,
                      uniform_query_len: int, max_len: int,
                      config: TritonConfig | None) -> tuple[TritonConfig, int, int, dict]:
    """(config, tiles, KV splits, constexprs) of one attention launch."""
    t, h, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    g = h // hkv
    if uniform_query_len:  # one tile per row, program i owns row i
        block_q = pow2(uniform_query_len)
        num_tiles = max(rows, -(-t // block_q))
    else:
        block_q = max(1, 64 // pow2(g))
        num_tiles = t // block_q + rows
    device_pdl = has_pdl(device_index(q.device))
    cfg = config or (decode_config(rows * hkv, device_pdl) if uniform_query_len
                     else PREFILL_CONFIG)
    if cfg.pdl and not device_pdl:
        raise ValueError(f"TritonConfig.pdl = True needs programmatic dependent launch (compute "
                         f"capability >= 9 and a Triton with gdc_wait), which {q.device} lacks")
    block_n, num_splits = tiles(cfg, rows, hkv, max(d, dv), max_len, q.device,
                                bool(uniform_query_len))
    consts = dict(G=g, HEAD_DIM=d, HEAD_DIM_V=dv, D_PAD=max(16, pow2(d)),
                  DV_PAD=max(16, pow2(dv)), BLOCK_Q=block_q, BLOCK_M=max(16, pow2(block_q * g)),
                  BLOCK_N=block_n, PAGE=k_cache.shape[1], UNIFORM=bool(uniform_query_len),
                  WRITE_LSE=False, USE_PDL=cfg.pdl)
    return cfg, num_tiles, num_splits, consts


def triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor, scale: float, uniform_query_len: int,
                     max_len: int, window: int, softcap: float, sinks: torch.Tensor | None,
                     config: TritonConfig | None = None,
                     rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     kv_start: torch.Tensor | None = None,
                     lse: torch.Tensor | None = None,
                     scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Paged attention through the unified kernel (+ the split merge); see
    `torch.ops.graphattn.paged_attention` for the arguments.

    `uniform_query_len`: every row has that many tokens (0: mixed rows); `max_len`: the
    bound of every row's length; `config`: the launch config (default `decode_config` for
    uniform rows, `PREFILL_CONFIG` otherwise); `rope`: (positions, inv_freq, slot_mapping) of
    a one-token decode launch whose `q` is the q-head view of a fused qkv
    (`rope_paged_decode`); `kv_start`: int32 [rows], each row's first key (default 0);
    `lse`: float32 [T * H], filled with each (token, head)'s natural log-sum-exp (-inf for
    padded tokens); `scales`: an fp8 cache's (k_scale, v_scale) (it holds K / k_scale and
    V / v_scale): K's folds into `scale`, V's multiplies the output in the kernel, and the
    rotary append stores its new K / V so. Returns [T, H, Dv] in q's dtype, 0 for padded
    tokens.
    """
    from graphattn.backends.triton_kernels import unified_attention_kernel

    t, h, d = q.shape
    dv = v_cache.shape[-1]
    if rope is not None and not (uniform_query_len == 1 and rope_fusable(d, k_cache, v_cache)):
        raise ValueError(f"the fused rotary decode takes one-token rows and a power-of-two "
                         f"head_dim >= 16 for K and V; got query length {uniform_query_len}, "
                         f"head_dim {d}, V head_dim {dv}")
    rows = block_table.shape[0]
    if lse is not None:  # padded tokens: the kernels write real tokens' only
        lse.fill_(float("-inf"))
    if t == 0 or rows == 0:
        return q.new_zeros(t, h, dv)
    if q.stride(-1) != 1:
        q = q.contiguous()
    cfg, num_tiles, num_splits, consts = _attention_launch(q, k_cache, v_cache, rows,
                                                           uniform_query_len, max_len, config)
    consts.update(USE_SOFTCAP=softcap > 0, USE_WINDOW=window > 0, USE_SINKS=sinks is not None,
                  USE_KV_START=kv_start is not None, WRITE_LSE=lse is not None,
                  FP8=is_fp8(k_cache.dtype))
    out = q.new_empty(t, h, dv)  # every token is written (0 for padded ones): no fill
    part = part_lse = out
    if num_splits > 1:
        part = torch.empty(t * h * num_splits, consts["DV_PAD"], dtype=torch.float32,
                           device=q.device)
        part_lse = torch.empty(t * h * num_splits, dtype=torch.float32, device=q.device)
    sink_arg = sinks if sinks is not None else out
    lse_arg = out if lse is None else lse
    unified_attention_kernel[(num_tiles, k_cache.shape[2], num_splits)](
        out, lse_arg, part, part_lse, q, k_cache, v_cache, block_table, seq_lens,
        query_start_loc, sink_arg, *(rope or (seq_lens,) * 3),
        seq_lens if kv_start is None else kv_start, scale * scales[0],
        softcap if softcap > 0 else 1.0, window, *map(float, scales), rows, h, t, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), SPLIT=num_splits > 1, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=cfg.pdl, ROPE_APPEND=rope is not None, **consts)
    if num_splits > 1:
        _merge_splits(out, lse_arg, part, part_lse, sink_arg, query_start_loc, rows, num_splits,
                      consts["DV_PAD"], sinks is not None, lse is not None, cfg.pdl)
    return out


def _merge_splits(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor,
                  part_lse: torch.Tensor, sinks: torch.Tensor, query_start_loc: torch.Tensor,
                  rows: int, num_splits: int, dv_pad: int, use_sinks: bool, write_lse: bool,
                  pdl: bool) -> None:
    """`merge_splits_kernel` over every (token, head) of `out`."""
    from graphattn.backends.triton_kernels import merge_splits_kernel

    t, h, dv = out.shape
    merge_splits_kernel[(t, h)](
        out, lse, part, part_lse, sinks, query_start_loc, rows, h, out.stride(0),
        out.stride(1), HEAD_DIM_V=dv, DV_PAD=dv_pad, NUM_SPLITS=num_splits,
        S_PAD=max(2, pow2(num_splits)), USE_SINKS=use_sinks, WRITE_LSE=write_lse,
        USE_PDL=pdl, num_warps=4, launch_pdl=pdl)


def launch_shared_prefix(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         prefix_table: torch.Tensor, key_hi: torch.Tensor,
                         key_lo: torch.Tensor | None, prefix_len: int, scale: float,
                         softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix pass of shared-prefix attention (`shared_prefix_kernel`): the prefix's
    keys read once per KV head for every (token, head) of a BLOCK_M tile, the prefix cut
    into parts (grid from CPU numbers: tokens, KV heads and `prefix_len`), and one part more
    left for the suffix pass (`merge_shared_prefix`).

    Returns
    -------
    part : float32 [T, H, S + 1, DV_PAD]; part_lse : float32 [T, H, S + 1], log2 units
        The prefix's S parts (-inf: nothing seen); part S is not written.
    """
    from graphattn.backends.triton_kernels import shared_prefix_kernel

    t, h, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    g, dv_pad = h // hkv, max(16, pow2(dv))
    block_m = max(16, min(64, pow2(t * g)))
    tiles_m = -(-t * g // block_m)
    block_n = 64 if max(d, dv) <= 128 else 32
    # parts so the grid fills the device about twice (a CPU choice; bounded by the prefix)
    sms = num_sms(q.device) if q.device.type == "cuda" else 8
    splits = max(1, min(-(-prefix_len // (4 * block_n)), -(-2 * sms // (tiles_m * hkv))))
    part = torch.empty(t, h, splits + 1, dv_pad, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(t, h, splits + 1, dtype=torch.float32, device=q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    shared_prefix_kernel[(tiles_m, hkv, splits)](
        part, part_lse, q, k_cache, v_cache, prefix_table, key_hi,
        key_hi if key_lo is None else key_lo, scale, softcap if softcap > 0 else 1.0, t, h,
        prefix_len, splits, splits + 1, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), G=g, HEAD_DIM=d, HEAD_DIM_V=dv, D_PAD=max(16, pow2(d)),
        DV_PAD=dv_pad, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=k_cache.shape[1],
        USE_SOFTCAP=softcap > 0, USE_WINDOW=key_lo is not None, num_warps=4)
    return part, part_lse


def merge_shared_prefix(part: torch.Tensor, part_lse: torch.Tensor, suffix: torch.Tensor,
                        suffix_lse: torch.Tensor, query_start_loc: torch.Tensor,
                        rows: int) -> torch.Tensor:
    """The prefix parts of `launch_shared_prefix` and the suffix pass's output merged by
    their log-sum-exp (`merge_splits_kernel`; padded tokens 0).

    Parameters
    ----------
    part, part_lse : see `launch_shared_prefix` (the last part is filled here)
    suffix : [T, H, Dv], the suffix pass's output
    suffix_lse : float32 [T * H], its natural log-sum-exp

    Returns
    -------
    torch.Tensor
        [T, H, Dv] in the suffix's dtype.
    """
    t, h, dv = suffix.shape
    part[:, :, -1, :dv] = suffix
    torch.mul(suffix_lse.view(t, h), 1.4426950408889634, out=part_lse[:, :, -1])
    out = suffix.new_empty(t, h, dv)
    _merge_splits(out, out, part, part_lse, out, query_start_loc, rows, part.shape[2],
                  part.shape[3], False, False, False)
    return out


def launch_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """K and V of T tokens into their slots in one launch (slot -1: no write; an fp8 cache
    stores K / k_scale and V / v_scale of `scales`)."""
    from graphattn.backends.triton_kernels import write_kv_kernel

    check_contiguous_caches("write_kv", k_cache, v_cache)
    t = k.shape[0]
    if t == 0:
        return
    k, v = k.reshape(t, -1), v.reshape(t, -1)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    row_k, row_v = k.shape[1], v.shape[1]
    write_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, *map(float, scales), k.stride(0),
                          v.stride(0), k_cache.stride(1), v_cache.stride(1), ROW_K=row_k,
                          ROW_V=row_v, BLOCK=min(1024, pow2(max(row_k, row_v))),
                          FP8=is_fp8(k_cache.dtype), num_warps=4)


def launch_rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                         scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Rotated queries [T, H, D] of a fused qkv, K/V written (one launch; an fp8 cache
    stores K / k_scale and V / v_scale of `scales`)."""
    from graphattn.backends.triton_kernels import rope_write_kv_kernel

    check_contiguous_caches("rope_write_kv", k_cache, v_cache)
    t, d = qkv.shape[0], 2 * inv_freq.shape[0]
    q = qkv.new_empty(t, num_heads, d)
    if t == 0:
        return q
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    pdl = has_pdl(device_index(qkv.device))
    rope_write_kv_kernel[(t,)](
        qkv, positions, inv_freq, q, k_cache, v_cache, slot_mapping, *map(float, scales),
        qkv.stride(0),
        q.stride(0), k_cache.stride(1), v_cache.stride(1), H=num_heads, HKV=num_kv_heads, D=d,
        H_PAD=pow2(num_heads), HKV_PAD=pow2(num_kv_heads), HALF_PAD=max(2, pow2(d // 2)),
        D_PAD=max(2, pow2(d)), USE_PDL=pdl, FP8=is_fp8(k_cache.dtype), num_warps=4,
        launch_pdl=pdl)
    return q
