"""Attention and the KV-cache write as registered custom ops (torch.library).

``torch.ops.graphattn.paged_attention``, ``torch.ops.graphattn.write_kv`` and
``torch.ops.graphattn.rope_write_kv`` (the rotary embedding fused with the write) and
``torch.ops.graphattn.rope_paged_decode`` (both fused into the attention, decode rows) are
opaque to torch.compile (fake implementations give the shapes), so a compiled forward
keeps them as single calls: the caches are mutated in place by `write_kv`, `rope_write_kv`
and `rope_paged_decode` (declared in ``mutates_args``) and never copied. The piecewise mode
splits compiled graphs at the attention op.

Kernels, chosen per call from the device and the `kernel` argument (CPU
strings only):

- ``"triton"``: `graphattn.backends.triton_kernels` (CUDA; Triton ships with
  every CUDA build of torch and is imported on first use).
- ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` with ``block_table``
  and ``seqused_k`` where the installed torch has them (feature-detected).
- ``"torch"``: the plain-torch path of `graphattn.backends.kernels`, the
  float64-capable reference and the CPU path.
- ``"auto"``: triton on CUDA when Triton imports, else torch.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from graphattn.backends.kernels import (
    gather_paged,
    grouped_attention,
    token_positions,
    token_request_index,
    write_to_cache,
)
from graphattn.backends.rope import apply_rope, cos_sin

__all__ = ["KERNELS", "PREFILL_CONFIG", "TritonConfig", "decode_config", "fuse_rope_decode",
           "gather_paged_attention", "has_pdl", "has_triton", "has_varlen_paged", "kv_bounds",
           "resolve_kernel", "rope_paged_decode", "rope_write_kv", "split_plan"]

KERNELS = ("auto", "triton", "varlen", "torch")


@dataclass(frozen=True, slots=True)
class TritonConfig:
    """Launch parameters of the unified kernel (chosen by scripts/tune_attention.py on an H200).

    Attributes
    ----------
    block_n : int
        Keys per inner-loop tile.
    num_warps, num_stages : int
    waves : int
        Split-KV target: programs >= waves x multiprocessors (uniform decode keys only;
        0: never split).
    pdl : bool
        Programmatic dependent launch of the attention and merge kernels (refused where
        `has_pdl` is False): a launch may overlap the previous kernel's tail, and every
        program waits for that kernel (``griddepcontrol.wait``) before it touches memory.
        `decode_config` turns it on where the device has it (0.2-1.4 µs less per call in
        bench/results/tune_attention_pdl.json).
    fuse_rope : bool
        One-token decode launches of this config may take the rotary embedding and the
        K/V write in (`rope_paged_decode`; see `fuse_rope_decode`).
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    waves: int = 2
    pdl: bool = False
    fuse_rope: bool = False


PREFILL_CONFIG = TritonConfig()


def decode_config(programs: int, pdl: bool = False) -> TritonConfig:
    """Launch config of a uniform-decode key with `programs` = rows x KV heads.

    From scripts/tune_attention.py on an H200 (bf16, head_dim 64, GQA 4, lengths 512-2048;
    bench/results/tune_attention.json): few programs split the KV axis over two waves, a
    middling count wants longer key tiles, and past about six waves no split and 64-key tiles
    read fastest (3.9 TB/s at 128 rows x 8 KV heads x 2048). Below 96 programs, 128-key tiles
    split over four waves (tune_attention_pdl.json: 14.1 against 16.7 µs at 8 rows x 8 KV
    heads x 2048). Every split bracket takes the rotary embedding in (`fuse_rope`; in one
    process, bench/results/config_ab_*_s8.json: 1b 8 x 2048 1,274 against 1,293 µs per step;
    tiny 32 x 512, the graph alone, 346 against 365 over two waves, which beat four there by
    9 µs and lost by 10 at 1b 8 x 2048: hence the cut at 96).

    Parameters
    ----------
    programs : int
        Rows x KV heads of the launch (CPU numbers).
    pdl : bool
        `TritonConfig.pdl` of the result (the caller knows the device: `has_pdl`).
    """
    if programs < 32:
        return TritonConfig(block_n=64, num_warps=4, num_stages=2, waves=2, pdl=pdl,
                            fuse_rope=True)
    if programs < 6 * 132:
        return TritonConfig(block_n=128, num_warps=4, num_stages=2,
                            waves=4 if programs < 96 else 2, pdl=pdl, fuse_rope=True)
    return TritonConfig(block_n=64, num_warps=4, num_stages=2, waves=1, pdl=pdl)


@functools.cache
def has_triton() -> bool:
    """Triton imports and a CUDA device exists."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def has_pdl(index: int) -> bool:
    """Programmatic dependent launch from Triton on CUDA device `index` (Hopper or newer,
    a Triton with ``gdc_wait``)."""
    if not has_triton() or torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def has_varlen_paged() -> bool:
    """The installed torch has varlen_attn with block_table / seqused_k."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    params = inspect.signature(varlen_attn).parameters
    return "block_table" in params and "seqused_k" in params


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """The kernel a call on `device` runs ("auto" resolved); ValueError when unavailable."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel = {kernel!r}, expected one of {KERNELS}")
    if kernel == "auto":
        return "triton" if device.type == "cuda" and has_triton() else "torch"
    if kernel == "triton" and not (device.type == "cuda" and has_triton()):
        raise ValueError(f"kernel 'triton' needs CUDA and Triton; device is {device.type}")
    if kernel == "varlen" and not (device.type == "cuda" and has_varlen_paged()):
        raise ValueError(
            f"kernel 'varlen' needs CUDA and torch.nn.attention.varlen.varlen_attn with "
            f"block_table (torch {torch.__version__}, device {device.type})"
        )
    return kernel


def split_plan(rows: int, num_kv_heads: int, max_len: int, block_n: int,
               num_sms: int = 132, waves: int = 2) -> int:
    """Splits of each row's KV axis from CPU numbers only.

    Enough programs to fill about `waves` waves of the chip, at most one split per
    `block_n` keys of `max_len` (the bound). The kernel cuts each row's own length,
    read on the device, into that many equal parts.
    """
    want = max(1, -(-waves * num_sms // max(rows * num_kv_heads, 1)))
    most = max(1, -(-max(max_len, 1) // block_n))
    return min(want, most, 64)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def gather_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_table: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                           num_decodes: int, decode_query_len: int, num_kv_blocks: int,
                           window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch paged attention (reference and CPU path); see `paged_attention`."""
    t_total = q.shape[0]
    nd, qd, nb = num_decodes, decode_query_len, num_kv_blocks
    ndt = nd * qd
    extra = dict(scale=scale, softcap=softcap, sinks=sinks)
    outs = []
    if nd:
        kc = gather_paged(k_cache, block_table[:nd], nb)
        vc = gather_paged(v_cache, block_table[:nd], nb)
        j = torch.arange(qd, device=q.device)
        hi = (seq_lens[:nd, None] - qd + 1 + j).clamp_(min=0)
        lo = (hi - window).clamp_(min=0) if window > 0 else None
        o, _ = grouped_attention(q[:ndt].reshape(nd, qd, *q.shape[1:]), kc, vc, hi, lo, **extra)
        outs.append(o.reshape(ndt, q.shape[1], v_cache.shape[-1]))
    rows = block_table.shape[0] - nd
    if t_total > ndt:
        if rows == 0:
            outs.append(q.new_zeros(t_total - ndt, q.shape[1], v_cache.shape[-1]))
        else:
            qsl = query_start_loc[nd:] - ndt
            req = token_request_index(qsl, t_total - ndt)
            pos = token_positions(qsl, seq_lens[nd:], req)
            valid = slot_mapping[ndt:t_total] >= 0
            hi = torch.where(valid, pos + 1, torch.zeros_like(pos))
            lo = (hi - window).clamp_(min=0).unsqueeze(1) if window > 0 else None
            kc = gather_paged(k_cache, block_table[nd:], nb)[req]
            vc = gather_paged(v_cache, block_table[nd:], nb)[req]
            o, _ = grouped_attention(q[ndt:].unsqueeze(1), kc, vc, hi.unsqueeze(1), lo, **extra)
            outs.append(o.squeeze(1))
    if not outs:
        return q.new_zeros(0, q.shape[1], v_cache.shape[-1])
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def kv_bounds(num_kv_blocks: int, max_len: int) -> torch.Tensor:
    """The `kv_bounds` argument of ``torch.ops.graphattn.paged_attention``: int64 CPU [2].

    Outside a traced function: one tensor per value, never to be written, marked as an
    unguarded static address (``torch._dynamo.mark_static_address(guard=False)``): dynamo
    does not recompile when the bucket changes, and inductor's CUDA-graph trees
    (``mode="reduce-overhead"``) take it as a static input, so they neither stage it into
    their device pool nor replay one bucket's launch for another: a new address (another
    bucket) records its own graph. Built inside a traced forward: a graph constant.
    """
    if torch.compiler.is_compiling():
        return torch.tensor([num_kv_blocks, max_len], dtype=torch.int64)
    return _static_kv_bounds(num_kv_blocks, max_len)


@functools.lru_cache(maxsize=4096)
def _static_kv_bounds(num_kv_blocks: int, max_len: int) -> torch.Tensor:
    import torch._dynamo

    with torch.inference_mode(False):
        t = torch.tensor([num_kv_blocks, max_len], dtype=torch.int64)
    torch._dynamo.mark_static_address(t, guard=False)
    return t


def _triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_table: torch.Tensor, scale: float, uniform_query_len: int,
                      max_len: int, window: int, softcap: float,
                      sinks: torch.Tensor | None,
                      config: TritonConfig | None = None,
                      rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                      ) -> torch.Tensor:
    """`rope`: (positions, inv_freq, slot_mapping) of a one-token decode launch whose `q` is
    the q-head view of a fused qkv (`rope_paged_decode`)."""
    from graphattn.backends.triton_kernels import merge_splits_kernel, unified_attention_kernel

    t, h, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[-1]
    if rope is not None and not (uniform_query_len == 1 and _rope_fusable(d, k_cache, v_cache)):
        raise ValueError(f"the fused rotary decode takes one-token rows and a power-of-two "
                         f"head_dim >= 16 for K and V; got query length {uniform_query_len}, "
                         f"head_dim {d}, V head_dim {dv}")
    g = h // hkv
    rows = block_table.shape[0]
    if t == 0 or rows == 0:
        return q.new_zeros(t, h, dv)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if uniform_query_len:  # one tile per row, program i owns row i
        block_q = _pow2(uniform_query_len)
        num_tiles = max(rows, -(-t // block_q))
    else:
        block_q = max(1, 64 // _pow2(g))
        num_tiles = t // block_q + rows
    block_m = max(16, _pow2(block_q * g))
    device_pdl = has_pdl(_device_index(q.device))
    cfg = config or (decode_config(rows * hkv, device_pdl) if uniform_query_len
                     else PREFILL_CONFIG)
    block_n, num_splits = _tiles(cfg, rows, hkv, max(d, dv), max_len, q.device,
                                 bool(uniform_query_len))
    dv_pad = max(16, _pow2(dv))
    pdl = cfg.pdl
    if pdl and not device_pdl:
        raise ValueError(f"TritonConfig.pdl = True needs programmatic dependent launch (compute "
                         f"capability >= 9 and a Triton with gdc_wait), which {q.device} lacks")
    common = dict(G=g, HEAD_DIM=d, HEAD_DIM_V=dv, D_PAD=max(16, _pow2(d)), DV_PAD=dv_pad,
                  BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=k_cache.shape[1],
                  UNIFORM=bool(uniform_query_len), USE_SOFTCAP=softcap > 0,
                  USE_WINDOW=window > 0, USE_SINKS=sinks is not None, WRITE_LSE=False,
                  USE_PDL=pdl, ROPE_APPEND=rope is not None)
    out = q.new_empty(t, h, dv)  # every token is written (0 for padded ones): no fill
    if num_splits == 1:
        part, part_lse = out, out
    else:
        part = torch.empty(t * h * num_splits, dv_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(t * h * num_splits, dtype=torch.float32, device=q.device)
    sink_arg = sinks if sinks is not None else out
    unified_attention_kernel[(num_tiles, hkv, num_splits)](
        out, out, part, part_lse, q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        sink_arg, *(rope or (seq_lens,) * 3), scale, softcap if softcap > 0 else 1.0, window,
        rows, h, t, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        out.stride(0), out.stride(1), SPLIT=num_splits > 1, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=pdl, **common)
    if num_splits > 1:
        merge_splits_kernel[(t, h)](
            out, out, part, part_lse, sink_arg, query_start_loc, rows, h, out.stride(0),
            out.stride(1), HEAD_DIM_V=dv, DV_PAD=dv_pad, NUM_SPLITS=num_splits,
            S_PAD=max(2, _pow2(num_splits)), USE_SINKS=sinks is not None, WRITE_LSE=False,
            USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def _rope_fusable(head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The fused rotary decode's shapes: K and V head_dim both `head_dim`, a power of two
    >= 16 (`rope_paged_decode` falls back to two ops otherwise; `_triton_attention` refuses)."""
    return k_cache.shape[-1] == v_cache.shape[-1] == head_dim == _pow2(head_dim) >= 16


def _tiles(cfg: TritonConfig, rows: int, num_kv_heads: int, head_dim: int, max_len: int,
           device: torch.device, uniform: bool) -> tuple[int, int]:
    """(keys per tile, KV splits) of a launch (splits: uniform decode keys only)."""
    block_n = cfg.block_n if head_dim <= 128 else min(cfg.block_n, 32)
    if not uniform:
        return block_n, 1
    return block_n, split_plan(rows, num_kv_heads, max_len, block_n, _num_sms(device),
                               cfg.waves)


def fuse_rope_decode(rows: int, num_kv_heads: int, head_dim: int, max_len: int,
                     device: torch.device, kernel: str = "auto") -> bool:
    """Whether a batch of `rows` one-token decode rows runs `rope_paged_decode` rather than
    `rope_write_kv` then attention (CPU numbers only; `PagedAttentionImpl.forward_qkv`).

    Fused, every program rotates its queries before its loop and holds more registers (sm90,
    head_dim 64, per thread: 82 against 64 unsplit at 64-key tiles, 118 against 96 split at
    128; `scripts/triton_compile_check.py`), so fewer programs may fit an SM. Measured on the
    H200: where the launch splits the KV axis it pays (1b 1 row: 39-53 µs, 32 rows: 58-61 µs
    less per step, bench/results/graph_replay.json, sessions 6 and 7; 1b 8 rows x 2048 and
    tiny 32 rows, one process, bench/results/config_ab_*_s8.json, 13-19 µs); with 1,024
    unsplit programs (1b 128 rows x 2048) it cost +472 µs, +14 % (config_ab_1b_128_2048.json,
    with libdevice's precise cos / sin). Hence `TritonConfig.fuse_rope` of `decode_config`,
    and only where the launch splits. Kernels other than Triton: True (the op runs the two
    ops itself).
    """
    if resolve_kernel(kernel, device) != "triton":
        return True
    cfg = decode_config(rows * num_kv_heads)
    return cfg.fuse_rope and _tiles(cfg, rows, num_kv_heads, head_dim, max_len, device,
                                    True)[1] > 1


@functools.cache
def _num_sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _num_sms(device: torch.device) -> int:
    return _num_sms_of(_device_index(device))


def _varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_table: torch.Tensor, scale: float, max_len: int,
                      window: int) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    max_q = q.shape[0]  # an upper bound from CPU numbers
    return varlen_attn(q, k_cache, v_cache, query_start_loc, None, max_q, max(max_len, 1),
                       scale=scale, window_size=(window - 1 if window > 0 else -1, 0),
                       enable_gqa=True, seqused_k=seq_lens, block_table=block_table)


def _read_bounds(kv_bounds: torch.Tensor) -> tuple[int, int]:
    """(num_kv_blocks, max_len) of a `kv_bounds` tensor; ValueError unless int64 CPU [2]."""
    if kv_bounds.device.type != "cpu" or tuple(kv_bounds.shape) != (2,):
        raise ValueError(f"kv_bounds must be an int64 CPU tensor of shape (2,) (reading it must "
                         f"not sync), got shape {tuple(kv_bounds.shape)} on {kv_bounds.device}")
    num_kv_blocks, max_len = kv_bounds.tolist()
    return num_kv_blocks, max_len


@torch.library.custom_op("graphattn::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                    num_decodes: int, decode_query_len: int, kv_bounds: torch.Tensor,
                    window: int, softcap: float, sinks: torch.Tensor | None,
                    kernel: str) -> torch.Tensor:
    """Causal attention of each query token over its row's paged KV (no host reads).

    Parameters
    ----------
    q : [T, H, D]
        T = tokens of the (padded) batch; rows own contiguous token ranges.
    k_cache, v_cache : [num_blocks (+ sink), block_size, Hkv, D] and [..., Dv]
    query_start_loc : int32 [rows + 1]; seq_lens : int32 [rows] (true lengths, device)
    block_table : int32 [rows, max_blocks]; slot_mapping : int64 [T] (-1: padded token)
    scale : float
    num_decodes, decode_query_len : int
        The first `num_decodes` rows have exactly `decode_query_len` tokens
        (all rows of a uniform key); picks the tile shape.
    kv_bounds : torch.Tensor
        int64 CPU [2]: (num_kv_blocks, max_len), upper bounds (the key's bucket) of the
        blocks / positions any row reads (`kv_bounds`). A CPU tensor rather than ints: read
        on the host when the op runs (no device sync), its value is not part of what
        torch.compile guards on, so one compiled forward serves every length bucket of a
        shape and each captured graph holds the launch of its own bucket.
    window : int
        Sliding window (a query at p sees keys > p - window); 0: none.
    softcap : float
        Logit soft cap (cap * tanh(s / cap)); 0: none.
    sinks : [H] float, optional
        Learned per-head sink logits added to each softmax denominator.
    kernel : str
        See the module docstring.

    Returns
    -------
    torch.Tensor
        [T, H, Dv] in q's dtype; 0 for padded tokens.
    """
    kind = resolve_kernel(kernel, q.device)
    rows = block_table.shape[0]
    num_kv_blocks, max_len = _read_bounds(kv_bounds)
    if kind == "triton":
        uniform = decode_query_len if num_decodes == rows and rows else 0
        return _triton_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                 scale, uniform, max_len, window, softcap, sinks)
    if kind == "varlen":
        if softcap > 0 or sinks is not None:
            raise ValueError("kernel 'varlen' supports neither softcap nor sinks")
        out = _varlen_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                scale, max_len, window)
    else:
        out = gather_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens,
                                     block_table, slot_mapping, scale, num_decodes,
                                     decode_query_len, num_kv_blocks, window, softcap, sinks)
    return out.contiguous()  # the layout the fake implementation promises


@paged_attention.register_fake
def _(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
      num_decodes, decode_query_len, kv_bounds, window, softcap, sinks, kernel):
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])


def _check_contiguous_caches(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError unless both caches are contiguous (the Triton kernels address slots by
    one stride)."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op} with kernel 'triton' needs contiguous caches")


@torch.library.custom_op("graphattn::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kernel: str) -> None:
    """Write token t's K/V into slot ``slot_mapping[t]`` of the caches, in place.

    Parameters
    ----------
    k, v : [T, Hkv, D] and [T, Hkv, Dv]
    k_cache, v_cache : [num_blocks + 1, block_size, Hkv, D] (last block: sink)
    slot_mapping : int64 [>= T]; -1 (padded token): the sink (torch) or no write (triton).
    kernel : str
        "triton" on CUDA writes K and V in one launch; otherwise index_copy_.
    """
    if resolve_kernel(kernel, k.device) != "triton":
        write_to_cache(k_cache, slot_mapping, k)
        write_to_cache(v_cache, slot_mapping, v)
        return
    from graphattn.backends.triton_kernels import write_kv_kernel

    _check_contiguous_caches("write_kv", k_cache, v_cache)
    t = k.shape[0]
    if t == 0:
        return
    k = k.reshape(t, -1)
    v = v.reshape(t, -1)
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    row_k, row_v = k.shape[1], v.shape[1]
    write_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                          k_cache.stride(1), v_cache.stride(1), ROW_K=row_k, ROW_V=row_v,
                          BLOCK=min(1024, _pow2(max(row_k, row_v))), num_warps=4)


@write_kv.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, kernel):
    return None


def _check_qkv(qkv: torch.Tensor, inv_freq: torch.Tensor, num_heads: int,
               num_kv_heads: int) -> int:
    """head_dim of a fused qkv [T, (H + 2 Hkv) * D] (D = 2 x inv_freq's length); ValueError
    naming the shapes otherwise."""
    d = 2 * inv_freq.shape[0]
    expect = (num_heads + 2 * num_kv_heads) * d
    if qkv.dim() != 2 or qkv.shape[1] != expect:
        raise ValueError(f"qkv has shape {tuple(qkv.shape)}, expected ({qkv.shape[0]}, "
                         f"{expect}) for {num_heads} heads, {num_kv_heads} KV heads, "
                         f"head_dim {d}")
    return d


@torch.library.custom_op("graphattn::rope_write_kv", mutates_args=("k_cache", "v_cache"))
def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int, num_kv_heads: int, kernel: str) -> torch.Tensor:
    """Rotary embedding of q and k from a fused qkv projection, K/V written to the caches.

    One launch on CUDA (Triton) instead of a rotation, a q copy, a k/v copy and the write.

    Parameters
    ----------
    qkv : [T, (H + 2 Hkv) * D]
        q heads, then k heads, then v heads, per token.
    positions : int64 [T]
    inv_freq : float32 [D / 2]
        Rotary frequencies (`graphattn.backends.rope.inv_frequencies`); the angle of
        token t is positions[t] * inv_freq in float32, rotating NeoX halves.
    k_cache, v_cache : [num_blocks (+ sink), block_size, Hkv, D], written in place
    slot_mapping : int64 [>= T]; -1 (padded token): the sink (torch) or no write (triton)
    num_heads, num_kv_heads : int
    kernel : str
        "triton" on CUDA runs the fused kernel; otherwise the plain-torch rope and
        index_copy_.

    Returns
    -------
    torch.Tensor
        [T, H, D] rotated queries, contiguous, in qkv's dtype.
    """
    t, d = qkv.shape[0], _check_qkv(qkv, inv_freq, num_heads, num_kv_heads)
    if resolve_kernel(kernel, qkv.device) != "triton":
        qk = apply_rope(qkv[:, : (num_heads + num_kv_heads) * d].view(t, -1, d),
                        *cos_sin(positions, inv_freq))
        write_to_cache(k_cache, slot_mapping, qk[:, num_heads:])
        write_to_cache(v_cache, slot_mapping, qkv[:, (num_heads + num_kv_heads) * d:]
                       .view(t, num_kv_heads, d))
        return qk[:, :num_heads].contiguous()
    from graphattn.backends.triton_kernels import rope_write_kv_kernel

    _check_contiguous_caches("rope_write_kv", k_cache, v_cache)
    q = qkv.new_empty(t, num_heads, d)
    if t == 0:
        return q
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    pdl = has_pdl(_device_index(qkv.device))
    rope_write_kv_kernel[(t,)](
        qkv, positions, inv_freq, q, k_cache, v_cache, slot_mapping, qkv.stride(0), q.stride(0),
        k_cache.stride(1), v_cache.stride(1), H=num_heads, HKV=num_kv_heads, D=d,
        H_PAD=_pow2(num_heads), HKV_PAD=_pow2(num_kv_heads), HALF_PAD=max(2, _pow2(d // 2)),
        D_PAD=max(2, _pow2(d)), USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return q


@rope_write_kv.register_fake
def _(qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
      kernel):
    return qkv.new_empty(qkv.shape[0], num_heads, 2 * inv_freq.shape[0])


@torch.library.custom_op("graphattn::rope_paged_decode", mutates_args=("k_cache", "v_cache"))
def rope_paged_decode(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_table: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                      num_heads: int, num_kv_heads: int, kv_bounds: torch.Tensor, window: int,
                      softcap: float, sinks: torch.Tensor | None, kernel: str) -> torch.Tensor:
    """`rope_write_kv` then `paged_attention` for a batch of one-token decode rows.

    On CUDA (Triton; a power-of-two head_dim >= 16 for K and V) one launch (plus the split
    merge) instead of two: every program rotates its queries, each row's last KV split
    rotates the new key, writes it and the value to their slot and seeds its softmax with
    them from registers; every split reads the cache below the new position only.
    Otherwise the two ops run.

    Parameters
    ----------
    qkv : [T, (H + 2 Hkv) * D]
        T >= rows; row i's token is qkv[i] (tokens past the last row: padding, output 0).
    positions : int64 [T]; inv_freq : float32 [D / 2]
        As in `rope_write_kv`.
    k_cache, v_cache : [num_blocks (+ sink), block_size, Hkv, D], written in place
    query_start_loc : int32 [rows + 1]; seq_lens : int32 [rows] (the new token counted)
    block_table : int32 [rows, max_blocks]; slot_mapping : int64 [>= T] (-1: padded token)
    scale : float
    num_heads, num_kv_heads : int
    kv_bounds, window, softcap, sinks, kernel
        As in `paged_attention`.

    Returns
    -------
    torch.Tensor
        [T, H, D] in qkv's dtype; 0 for padded tokens.
    """
    t, d = qkv.shape[0], _check_qkv(qkv, inv_freq, num_heads, num_kv_heads)
    rows = block_table.shape[0]
    if t < rows:
        raise ValueError(f"qkv has {t} tokens, expected >= {rows} (one per row of block_table)")
    max_len = _read_bounds(kv_bounds)[1]
    if resolve_kernel(kernel, qkv.device) == "triton" and _rope_fusable(d, k_cache, v_cache):
        _check_contiguous_caches("rope_paged_decode", k_cache, v_cache)
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        q = qkv.view(t, num_heads + 2 * num_kv_heads, d)[:, :num_heads]
        return _triton_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                 scale, 1, max_len, window, softcap, sinks,
                                 rope=(positions, inv_freq, slot_mapping))
    q = rope_write_kv(qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, num_heads,
                      num_kv_heads, kernel)
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                           slot_mapping, scale, rows, 1, kv_bounds, window, softcap, sinks,
                           kernel)


@rope_paged_decode.register_fake
def _(qkv, positions, inv_freq, k_cache, v_cache, query_start_loc, seq_lens, block_table,
      slot_mapping, scale, num_heads, num_kv_heads, kv_bounds, window, softcap, sinks, kernel):
    return qkv.new_empty(qkv.shape[0], num_heads, 2 * inv_freq.shape[0])
