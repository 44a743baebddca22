"""Launches of the Triton kernels (`graphattn.backends.triton_kernels`, imported on first
use): grid, tiles and constexprs from CPU numbers only, never a host read of device data."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from graphattn.backends.launch_config import (
    PREFILL_CONFIG,
    PREFIX_PASS_CONFIG,
    TILE_ELEMENTS,
    TritonConfig,
    decode_config,
    device_index,
    has_pdl,
    head_tile,
    num_sms,
    pow2,
    rope_fusable,
    tiles,
)
from graphattn.backends.reference import is_fp8
from graphattn.transfer import CurrentStream

__all__ = ["SPLIT_COUNTERS", "Append", "SplitCounters", "check_contiguous_caches",
           "indexer_scores", "launch_rope_write_kv", "launch_shared_prefix", "launch_write_kv",
           "merge_consts", "triton_attention", "triton_cascade"]


@dataclass(frozen=True, slots=True)
class Append:
    """The new token of each one-token decode row, written inside the attention launch.

    Attributes
    ----------
    k, v : [T, Hkv, D]
        Each token's new key and value (any strides along T and the heads).
    slot_mapping : int64 [>= T]
        Their cache slots (-1: no write).
    positions : int64 [T], optional
    inv_freq : float32 [D / 2], optional
        Both given: q and the new key are rotated in the launch first (NeoX halves, angle
        positions[t] * inv_freq; `rope_paged_attention`); both None: they come rotated.
    """

    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor | None = None
    inv_freq: torch.Tensor | None = None


class SplitCounters:
    """Zeroed int32 counters on which the splits of a launch count themselves
    (`TritonConfig.merge`), one buffer per (device, stream): launches on one stream run one
    after another, and each launch's last split puts its counter back to 0.

    A buffer is made outside stream capture only (a runner's warm-ups run on its capture
    stream first); a launch captured on a stream without one big enough merges in the
    separate kernel. Buffers live as long as the process: captured graphs hold their
    addresses. Graphs captured on one stream share its buffer, so they must not run at the
    same time (the runner replays its graphs one after another on one stream).
    """

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._current: dict[torch.device, CurrentStream] = {}

    def buffers(self, device: torch.device, stream_id: int = 0) -> list[torch.Tensor]:
        """The buffers made for `device` and the stream of that ``stream_id`` (0 off CUDA),
        oldest first."""
        return list(self._held.get((str(device), stream_id), ()))

    def get(self, device: torch.device, n: int) -> torch.Tensor | None:
        """A zeroed buffer of at least `n` counters for the current stream, or None."""
        cuda = device.type == "cuda"
        if cuda and device not in self._current:
            self._current[device] = CurrentStream(device)
        stream_id = self._current[device]().stream_id if cuda else 0
        held = self._held.setdefault((str(device), stream_id), [])
        if held and held[-1].numel() >= n:
            return held[-1]
        if cuda and torch.cuda.is_current_stream_capturing():
            return None
        held.append(torch.zeros(max(4096, pow2(n)), dtype=torch.int32, device=device))
        return held[-1]


SPLIT_COUNTERS = SplitCounters()


def check_contiguous_caches(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError unless both caches are contiguous (the Triton kernels address slots by
    one stride)."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op} with kernel 'triton' needs contiguous caches")


def _attention_launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: int,
                      uniform_query_len: int, max_len: int,
                      config: TritonConfig | None) -> tuple[TritonConfig, int, int, dict]:
    """(config, tiles, KV splits, constexprs) of one attention launch; the grid is
    (tiles x head groups, KV heads, splits)."""
    t, h, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    g, d_pad = h // hkv, max(16, pow2(max(d, dv)))
    device_pdl = has_pdl(device_index(q.device))
    cfg = config or (decode_config(rows * hkv, device_pdl, k_cache.element_size())
                     if uniform_query_len else PREFILL_CONFIG)
    g_tile = head_tile(g, max(uniform_query_len, 1), d_pad, cfg.head_tile)
    if uniform_query_len:  # one tile per row, program i owns row i
        block_q = pow2(uniform_query_len)
        num_tiles = max(rows, -(-t // block_q))
    else:
        block_q = max(1, min(64 // pow2(g_tile), TILE_ELEMENTS // d_pad // g_tile))
        num_tiles = t // block_q + rows
    if cfg.pdl and not device_pdl:
        raise ValueError(f"TritonConfig.pdl = True needs programmatic dependent launch (compute "
                         f"capability >= 9 and a Triton with gdc_wait), which {q.device} lacks")
    block_n, num_splits = tiles(cfg, rows, h // g_tile, max(d, dv), max_len, q.device,
                                bool(uniform_query_len))
    consts = dict(G=g, G_TILE=g_tile, HEAD_DIM=d, HEAD_DIM_V=dv, D_PAD=max(16, pow2(d)),
                  DV_PAD=max(16, pow2(dv)), BLOCK_Q=block_q,
                  BLOCK_M=max(16, pow2(block_q * g_tile)),
                  BLOCK_N=block_n, PAGE=k_cache.shape[1], UNIFORM=bool(uniform_query_len),
                  USE_PDL=cfg.pdl, PREFETCH_PAGES=cfg.prefetch_pages)
    return cfg, num_tiles, num_splits, consts


def triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor, scale: float, uniform_query_len: int,
                     max_len: int, window: int, softcap: float, sinks: torch.Tensor | None,
                     config: TritonConfig | None = None,
                     append: Append | None = None,
                     kv_start: torch.Tensor | None = None,
                     parts: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                     scales: tuple[float, float] = (1.0, 1.0),
                     prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
                     launch: tuple[TritonConfig, int, int, dict] | None = None
                     ) -> torch.Tensor | None:
    """Paged attention through the unified kernel, its splits merged in the launch or by the
    merge kernel (`_split_counters`); see `torch.ops.graphattn.paged_attention`.

    `uniform_query_len`: every row has that many tokens (0: mixed rows); `max_len`: the
    bound of every row's length; `config`: the launch config (default `decode_config` for
    uniform rows, `PREFILL_CONFIG` otherwise); `append`: the new K/V of a one-token decode
    launch, written by it (`Append`; `append_paged_attention`, `rope_paged_attention`);
    `kv_start`: int32 [rows], each row's first key (default 0);
    `parts`: (part [T, H, P, DV_PAD], part_lse [T, H, P], base): write the splits' partials
    at parts base, base + 1, ... and merge nothing (returns None; `triton_cascade`);
    `prefix`: (part [T, H, S, DV_PAD], part_lse [T, H, S]) of a prefix pass, which each
    program's softmax starts from (an unsplit launch only; `triton_cascade`);
    `scales`: an fp8 cache's (k_scale, v_scale): K's folds into `scale`, V's multiplies the
    output, and the rotary append stores its new K / V divided by them; `launch`: the
    caller's `_attention_launch` of this call. Returns [T, H, Dv] in q's dtype (0: padded).
    """
    (t, h, d), dv, rows = q.shape, v_cache.shape[-1], block_table.shape[0]
    append = _checked_append(append, d, k_cache, v_cache, uniform_query_len)
    if t == 0 or rows == 0:
        return None if parts is not None else q.new_zeros(t, h, dv)
    q = q if q.stride(-1) == 1 else q.contiguous()
    cfg, num_tiles, num_splits, consts = launch or _attention_launch(
        q, k_cache, v_cache, rows, uniform_query_len, max_len, config)
    grid = (num_tiles * (consts["G"] // consts["G_TILE"]), k_cache.shape[2], num_splits)
    counters = _split_counters(cfg, q.device, grid, parts is not None)
    consts = dict(consts, USE_SOFTCAP=softcap > 0, USE_WINDOW=window > 0,
                  USE_SINKS=sinks is not None and parts is None,
                  USE_KV_START=kv_start is not None, FP8=is_fp8(k_cache.dtype),
                  SPLIT=num_splits > 1 or parts is not None, APPEND=append is not None,
                  ROTATE=append is not None and append.inv_freq is not None,
                  PREFIX_PARTS=0 if prefix is None else prefix[1].shape[-1],
                  **merge_consts(counters is not None, num_splits, consts))
    # not filled: every token is written (0 when padded); with `parts`, only a placeholder
    out = q.new_empty(t, h, dv) if parts is None else parts[0]
    part, part_lse, base, num_parts = _partials(out, parts, prefix, num_splits, consts["DV_PAD"])
    sink_arg = sinks if sinks is not None else out
    _launch_unified(cfg, grid, consts, out, part, part_lse, q, k_cache, v_cache, block_table,
                    seq_lens, query_start_loc, sink_arg, *_append_args(append, q, seq_lens),
                    seq_lens if kv_start is None else kv_start,
                    seq_lens if counters is None else counters, scale * scales[0],
                    softcap if softcap > 0 else 1.0, window, *map(float, scales), rows, h, t,
                    num_splits, num_parts, base, append=append)
    if parts is not None:
        return None
    if num_splits > 1 and counters is None:
        _merge_splits(out, part, part_lse, sink_arg, query_start_loc, rows, num_splits,
                      consts["DV_PAD"], sinks is not None, cfg.pdl)
    return out


def _split_counters(cfg: TritonConfig, device: torch.device, grid: tuple[int, int, int],
                    to_parts: bool) -> torch.Tensor | None:
    """The counters on which a split launch of `grid` merges its splits itself, or None
    (the merge kernel merges them): unsplit, `cfg.merge` off, partials kept for the caller
    (`to_parts`), or a stream without `SPLIT_COUNTERS` under capture."""
    if not cfg.merge or grid[2] == 1 or to_parts:
        return None
    return SPLIT_COUNTERS.get(device, grid[0] * grid[1])


def merge_consts(merge: bool, num_splits: int, consts: dict) -> dict:
    """The unified kernel's MERGE (the split count's power of two; 0: the merge kernel
    merges) and MERGE_CHUNK (splits a load in the last split's fold: a [chunk, BLOCK_M,
    DV_PAD] tile of 2,048 values at most; built for sm_90, larger chunks raised the decode
    tile's registers from 80 to 168 and more, `bench.triton_compile_check`)."""
    if not merge:
        return {"MERGE": 0, "MERGE_CHUNK": 1}
    s_pad = max(2, pow2(num_splits))
    tile = consts["BLOCK_M"] * consts["DV_PAD"]
    return {"MERGE": s_pad, "MERGE_CHUNK": max(1, min(s_pad, 2048 // tile))}


def _checked_append(append: Append | None, d: int, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, uniform_query_len: int) -> Append | None:
    """`append` with unit-stride K/V rows; ValueError where the launch cannot take it."""
    if append is None:
        return None
    if not (uniform_query_len == 1 and rope_fusable(d, k_cache, v_cache)):
        raise ValueError(f"the fused K/V append takes one-token rows and a power-of-two "
                         f"head_dim >= 16 for K and V; got query length {uniform_query_len}, "
                         f"head_dim {d}, V head_dim {v_cache.shape[-1]}")
    if append.k.stride(-1) != 1 or append.v.stride(-1) != 1:
        return replace(append, k=append.k.contiguous(), v=append.v.contiguous())
    return append


def _append_args(append: Append | None, q: torch.Tensor, seq_lens: torch.Tensor) -> tuple:
    """The kernel's k_new, v_new, positions, inv_freq and slot_mapping arguments (unused
    ones: a placeholder tensor)."""
    if append is None:
        return (q, q, seq_lens, seq_lens, seq_lens)
    rot = (append.positions, append.inv_freq) if append.inv_freq is not None else (seq_lens,) * 2
    return (append.k, append.v, *rot, append.slot_mapping)


def _partials(out: torch.Tensor, parts: tuple[torch.Tensor, torch.Tensor, int] | None,
              prefix: tuple[torch.Tensor, torch.Tensor] | None, num_splits: int,
              dv_pad: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(part, part_lse, part_base, num_parts) of a launch writing `out` [T, H, Dv]: the
    caller's `parts`, the prefix pass's partials it starts from (ValueError for a split
    launch), fresh buffers for its own splits, or `out` as a placeholder (unsplit)."""
    if parts is not None:
        return parts[0], parts[1], parts[2], parts[1].shape[-1]
    if prefix is not None:
        if num_splits > 1:
            raise ValueError(f"a prefix pass's partials fold into an unsplit launch only; "
                             f"this one has {num_splits} splits")
        return prefix[0], prefix[1], 0, prefix[1].shape[-1]
    if num_splits == 1:
        return out, out, 0, 1
    n = out.shape[0] * out.shape[1] * num_splits
    return (torch.empty(n, dv_pad, dtype=torch.float32, device=out.device),
            torch.empty(n, dtype=torch.float32, device=out.device), 0, num_splits)


def _launch_unified(cfg: TritonConfig, grid: tuple[int, int, int], consts: dict,
                    out: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor,
                    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, *args: object,
                    append: Append | None = None) -> None:
    """`unified_attention_kernel` over `grid`; `args`: its arguments from seq_lens to
    part_base, in its order."""
    from graphattn.backends.triton_kernels import unified_attention_kernel

    new = (0,) * 4 if append is None else (*append.k.stride()[:2], *append.v.stride()[:2])
    unified_attention_kernel[grid](
        out, part, part_lse, q, k_cache, v_cache, block_table, *args,
        q.stride(0), q.stride(1), *new, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        launch_pdl=cfg.pdl, **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
        **consts)


def _merge_splits(out: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor,
                  sinks: torch.Tensor, query_start_loc: torch.Tensor, rows: int,
                  num_splits: int, dv_pad: int, use_sinks: bool, pdl: bool) -> None:
    """`merge_splits_kernel` over every (token, head) of `out`."""
    from graphattn.backends.triton_kernels import merge_splits_kernel

    t, h, dv = out.shape
    merge_splits_kernel[(t, h)](
        out, part, part_lse, sinks, query_start_loc, rows, h, num_splits, out.stride(0),
        out.stride(1), HEAD_DIM_V=dv, DV_PAD=dv_pad, S_PAD=max(2, pow2(num_splits)),
        USE_SINKS=use_sinks, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)


def triton_cascade(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   block_table: torch.Tensor, scale: float, uniform_query_len: int,
                   max_len: int, shared_rows: torch.Tensor, shared_prefix: int, window: int,
                   softcap: float, sinks: torch.Tensor | None,
                   prefix_config: TritonConfig | None = None) -> torch.Tensor:
    """Shared-prefix attention: the prefix pass (`shared_prefix_kernel`, its token bounds and
    the group's block table found in the kernel), then the suffix pass (the unified kernel
    from each group row's `shared_prefix`, from 0 for the others). An unsplit suffix pass
    starts each softmax from the prefix's partials and writes the output (two launches);
    a split one writes its partials beside the prefix's, merged by one
    `merge_splits_kernel` (three; the sinks counted once either way). Arguments as
    `torch.ops.graphattn.cascade_attention`'s (`prefix_config`: the prefix pass's launch,
    `launch_shared_prefix`); returns [T, H, Dv] in q's dtype, 0 for padded tokens."""
    t, h, _ = q.shape
    rows, dv = block_table.shape[0], v_cache.shape[-1]
    if t == 0 or rows == 0:
        return q.new_zeros(t, h, dv)
    if q.stride(-1) != 1:
        q = q.contiguous()
    suffix = _attention_launch(q, k_cache, v_cache, rows, uniform_query_len, max_len, None)
    fold = suffix[2] == 1
    part, part_lse, splits = launch_shared_prefix(
        q, k_cache, v_cache, block_table, query_start_loc, seq_lens, shared_rows,
        shared_prefix, scale, softcap, window, 0 if fold else suffix[2], uniform_query_len,
        prefix_config)
    if fold:
        return triton_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                scale, uniform_query_len, max_len, window, softcap, sinks,
                                kv_start=shared_rows, prefix=(part, part_lse), launch=suffix)
    triton_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale,
                     uniform_query_len, max_len, window, softcap, None, kv_start=shared_rows,
                     parts=(part, part_lse, splits), launch=suffix)
    out = q.new_empty(t, h, dv)
    _merge_splits(out, part, part_lse, out if sinks is None else sinks, query_start_loc, rows,
                  part_lse.shape[-1], part.shape[-1], sinks is not None, False)
    return out


def launch_shared_prefix(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_table: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, shared_rows: torch.Tensor, prefix_len: int,
                         scale: float, softcap: float, window: int, extra_parts: int,
                         uniform_query_len: int = 0, config: TritonConfig | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The prefix pass of shared-prefix attention (`shared_prefix_kernel`): the prefix's
    keys read once per KV head for every (token, head) of a BLOCK_M tile, the prefix cut
    into S parts so the grid fills the device about twice (CPU numbers: tokens, KV heads,
    `prefix_len`), and `extra_parts` more parts left for the suffix pass;
    `uniform_query_len` > 0: every row has that many tokens (a token's row is then its
    index over it; 0: each token's row is searched in `query_start_loc`). `config`
    (default `PREFIX_PASS_CONFIG`): keys per tile (at most 32 past 128 dims), warps,
    stages, and `waves`, the programs wanted per multiprocessor (a split holds at least
    four tiles).

    Returns
    -------
    part : float32 [T, H, S + extra_parts, DV_PAD]; part_lse : float32 [T, H, S + extra],
        log2 units; the prefix's S parts written (-inf: nothing seen).
    S : int
    """
    from graphattn.backends.triton_kernels import shared_prefix_kernel

    t, h, d = q.shape
    rows, hkv, dv = block_table.shape[0], k_cache.shape[2], v_cache.shape[-1]
    g, dv_pad = h // hkv, max(16, pow2(dv))
    block_m = max(16, min(64, pow2(t * g)))
    tiles_m = -(-t * g // block_m)
    cfg = config or PREFIX_PASS_CONFIG
    block_n = cfg.block_n if max(d, dv) <= 128 else min(cfg.block_n, 32)
    sms = num_sms(q.device) if q.device.type == "cuda" else 8
    splits = max(1, min(-(-prefix_len // (4 * block_n)),
                        -(-cfg.waves * sms // (tiles_m * hkv))))
    n = splits + extra_parts
    part = torch.empty(t, h, n, dv_pad, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(t, h, n, dtype=torch.float32, device=q.device)
    shared_prefix_kernel[(tiles_m, hkv, splits)](
        part, part_lse, q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
        shared_rows, scale, softcap if softcap > 0 else 1.0, window, rows, t, h, prefix_len,
        splits, n, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), G=g, HEAD_DIM=d, HEAD_DIM_V=dv, D_PAD=max(16, pow2(d)),
        DV_PAD=dv_pad, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=k_cache.shape[1],
        ROWS_PAD=max(2, pow2(rows)), LOG_ROWS=rows.bit_length() + 1, Q_LEN=uniform_query_len,
        USE_SOFTCAP=softcap > 0, USE_WINDOW=window > 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return part, part_lse, splits


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


def indexer_scores(q_idx: torch.Tensor, weights: torch.Tensor, idx_cache: torch.Tensor,
                   block_table: torch.Tensor, row_of: torch.Tensor, pos_of: torch.Tensor,
                   width: int) -> torch.Tensor:
    """The lightning indexer's scores over the paged index cache (`indexer_scores_kernel`).

    Parameters
    ----------
    q_idx : [T, Hi, Di]; weights : float32 [T, Hi]
    idx_cache : [blocks + 1, block_size, 1, Di], q_idx's dtype
    block_table : int32 [rows, blocks]; row_of : int [T], each token's row in it
    pos_of : int [T], each token's position (-1: a padded token)
    width : int
        Positions scored per token (a CPU bound: the span's blocks x block_size).

    Returns
    -------
    torch.Tensor
        float32 [T, width]; -inf past each token's position.
    """
    from graphattn.backends.triton_kernels import indexer_scores_kernel

    t, hi, di = q_idx.shape
    score = torch.empty(t, width, dtype=torch.float32, device=q_idx.device)
    if t == 0:
        return score
    if q_idx.stride(-1) != 1:
        q_idx = q_idx.contiguous()
    block_l = 64 if di <= 128 and q_idx.element_size() < 4 else 32
    indexer_scores_kernel[(t, -(-width // block_l))](
        score, q_idx, weights, idx_cache, block_table, row_of.to(torch.int32),
        pos_of.to(torch.int32), width, q_idx.stride(0), q_idx.stride(1), weights.stride(0),
        idx_cache.stride(0), idx_cache.stride(1), block_table.stride(0), score.stride(0),
        HI=hi, HI_PAD=max(16, pow2(hi)), DI=di, DI_PAD=max(16, pow2(di)), BLOCK_L=block_l,
        PAGE=idx_cache.shape[1], IEEE=q_idx.dtype == torch.float32, num_warps=4)
    return score
