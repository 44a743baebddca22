"""Attention and the KV-cache write as registered custom ops (torch.library).

``torch.ops.graphattn.paged_attention``, ``torch.ops.graphattn.cascade_attention`` (a
shared prefix read once for a group of rows), ``torch.ops.graphattn.write_kv``,
``torch.ops.graphattn.rope_write_kv`` (the rotary embedding fused with the write),
``torch.ops.graphattn.append_paged_attention`` (the write, then the attention: one launch
for one-token decode rows) and ``torch.ops.graphattn.rope_paged_attention`` (the rotation
too) are opaque to torch.compile (fake implementations give the shapes),
so a compiled forward keeps them as single calls: the caches are mutated in place (declared
in ``mutates_args``) and never copied. The piecewise mode splits compiled graphs at these
ops. Each op picks its kernel from the device and its `kernel` argument
(`graphattn.backends.launch_config`).
"""

from __future__ import annotations

import functools

import torch

from graphattn.backends.launch_config import fuse_rope_decode, resolve_kernel, rope_fusable
from graphattn.backends.reference import (
    cascade_paged_attention,
    gather_paged_attention,
    is_fp8,
    write_to_cache,
)
from graphattn.backends.rope import apply_rope, cos_sin
from graphattn.backends.triton_launch import (
    Append,
    check_contiguous_caches,
    launch_rope_write_kv,
    launch_write_kv,
    triton_attention,
    triton_cascade,
)

__all__ = ["append_paged_attention", "cascade_attention", "kv_bounds", "paged_attention",
           "rope_paged_attention", "rope_write_kv", "write_kv"]


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
                    kernel: str, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
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
    k_scale, v_scale : float
        An fp8 cache's scales (stored x scale = K or V): K's folds into `scale`, V's
        multiplies the output.

    Returns
    -------
    torch.Tensor
        [T, H, Dv] in q's dtype; 0 for padded tokens.
    """
    kind, rows = resolve_kernel(kernel, q.device), block_table.shape[0]
    num_kv_blocks, max_len = _read_bounds(kv_bounds)
    if kind == "triton":
        uniform = decode_query_len if num_decodes == rows and rows else 0
        return triton_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                scale, uniform, max_len, window, softcap, sinks,
                                scales=(k_scale, v_scale))
    scale = scale * k_scale
    if kind == "varlen":
        if softcap > 0 or sinks is not None or is_fp8(k_cache.dtype):
            raise ValueError("kernel 'varlen' supports neither softcap, sinks nor fp8 caches")
        out = _varlen_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                scale, max_len, window)
    else:
        out = gather_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens,
                                     block_table, slot_mapping, scale, num_decodes,
                                     decode_query_len, num_kv_blocks, window, softcap, sinks)
    return _scaled(out, v_scale).contiguous()  # the layout the fake implementation promises


def _scaled(out: torch.Tensor, v_scale: float) -> torch.Tensor:
    """`out` times an fp8 cache's V scale (as is for 1)."""
    return out if v_scale == 1.0 else out * v_scale


@paged_attention.register_fake
def _(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
      num_decodes, decode_query_len, kv_bounds, window, softcap, sinks, kernel, k_scale=1.0,
      v_scale=1.0):
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])


@torch.library.custom_op("graphattn::cascade_attention", mutates_args=())
def cascade_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                      block_table: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                      num_decodes: int, decode_query_len: int, kv_bounds: torch.Tensor,
                      shared_rows: torch.Tensor, shared_prefix: int,
                      window: int, softcap: float, sinks: torch.Tensor | None,
                      kernel: str, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """`paged_attention` with a prefix that a group of rows shares, read once per KV head.

    The rows with ``shared_rows[r] = shared_prefix`` (the others 0) hold the same first
    ``shared_prefix / block_size`` blocks (read-only: below each one's computed tokens);
    the prefix's keys are read once for all their tokens through the first such row's
    block table, each row's own keys from position `shared_prefix` on (from 0 outside the
    group), and the two partial softmaxes are merged by their log-sum-exp
    (`triton_cascade`: two launches, three where the suffix pass splits). Sinks count once.

    Parameters
    ----------
    shared_rows : int32 [rows] (device)
        `shared_prefix` for the group's rows (each one's first own key), 0 for the others.
    shared_prefix : int
        Tokens of the shared prefix, a multiple of the block size (the graph key's).
    Others : see `paged_attention`.

    Returns
    -------
    torch.Tensor
        [T, H, Dv] in q's dtype; 0 for padded tokens.
    """
    bs = k_cache.shape[1]
    if shared_prefix <= 0 or shared_prefix % bs:
        raise ValueError(f"shared_prefix = {shared_prefix}, expected a positive multiple of "
                         f"the block size {bs}")
    num_kv_blocks, max_len = _read_bounds(kv_bounds)
    if resolve_kernel(kernel, q.device) != "triton":
        return _scaled(cascade_paged_attention(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping,
            scale * k_scale, num_kv_blocks, shared_rows, shared_prefix, window, softcap, sinks),
            v_scale).contiguous()
    rows = block_table.shape[0]
    uniform = decode_query_len if num_decodes == rows and rows else 0
    return _scaled(triton_cascade(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                  scale * k_scale, uniform, max_len, shared_rows, shared_prefix,
                                  window, softcap, sinks), v_scale)


@cascade_attention.register_fake
def _(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
      num_decodes, decode_query_len, kv_bounds, shared_rows, shared_prefix, window, softcap,
      sinks, kernel, k_scale=1.0, v_scale=1.0):
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])


@torch.library.custom_op("graphattn::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kernel: str, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    """Write token t's K/V into slot ``slot_mapping[t]`` of the caches, in place.

    Parameters
    ----------
    k, v : [T, Hkv, D] and [T, Hkv, Dv]
    k_cache, v_cache : [num_blocks + 1, block_size, Hkv, D] (last block: sink)
    slot_mapping : int64 [>= T]; -1 (padded token): the sink (torch) or no write (triton).
    kernel : str
        "triton" on CUDA writes K and V in one launch; otherwise index_copy_.
    k_scale, v_scale : float
        An fp8 cache stores K / k_scale and V / v_scale (clamped to its range).
    """
    if resolve_kernel(kernel, k.device) != "triton":
        write_to_cache(k_cache, slot_mapping, k, k_scale)
        write_to_cache(v_cache, slot_mapping, v, v_scale)
        return
    launch_write_kv(k, v, k_cache, v_cache, slot_mapping, (k_scale, v_scale))


@write_kv.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, kernel, k_scale=1.0, v_scale=1.0):
    return None


@torch.library.custom_op("graphattn::append_paged_attention",
                         mutates_args=("k_cache", "v_cache"))
def append_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           block_table: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                           num_decodes: int, decode_query_len: int, kv_bounds: torch.Tensor,
                           window: int, softcap: float, sinks: torch.Tensor | None,
                           kernel: str, k_scale: float = 1.0, v_scale: float = 1.0,
                           auto: bool = False) -> torch.Tensor:
    """`write_kv` then `paged_attention`, fused for a batch of one-token decode rows.

    As `rope_paged_attention` without the rotation (q and k come rotated, or the model has
    no rotary embedding): a batch whose rows are all one-token decodes runs on CUDA
    (Triton; K and V of one power-of-two head_dim >= 16) in one launch (plus the split
    merge) where the write and the attention take two; the path is picked here from the
    plan's ints, so a compiled caller holds one call for every batch.

    Parameters
    ----------
    q : [T, H, D]; k, v : [T, Hkv, D]
        Any strides; tokens past the last row: padding, output 0.
    k_cache, v_cache, slot_mapping, k_scale, v_scale
        As in `write_kv` (caches written in place).
    query_start_loc, seq_lens (the new tokens counted), block_table, scale, num_decodes,
    decode_query_len, kv_bounds, window, softcap, sinks, kernel
        As in `paged_attention`.
    auto : bool
        Fuse only where it pays (`graphattn.backends.launch_config.fuse_rope_decode`;
        default: wherever the kernel can).

    Returns
    -------
    torch.Tensor
        [T, H, D] in q's dtype; 0 for padded tokens.
    """
    t, rows, hkv = q.shape[0], block_table.shape[0], k_cache.shape[2]
    for name, x, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if tuple(x.shape) != (t, hkv, cache.shape[-1]):
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected "
                             f"{(t, hkv, cache.shape[-1])} (q's tokens, the {name} cache's "
                             f"heads and head_dim)")
    max_len, fused = _decode_launch("q", q, q.shape[-1], k_cache, v_cache, rows, num_decodes,
                                    decode_query_len, kv_bounds, kernel, auto)
    if fused:
        check_contiguous_caches("append_paged_attention", k_cache, v_cache)
        return triton_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                scale, 1, max_len, window, softcap, sinks,
                                append=Append(k, v, slot_mapping), scales=(k_scale, v_scale))
    write_kv(k, v, k_cache, v_cache, slot_mapping, kernel, k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                           slot_mapping, scale, num_decodes, decode_query_len, kv_bounds,
                           window, softcap, sinks, kernel, k_scale, v_scale)


@append_paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, query_start_loc, seq_lens, block_table, slot_mapping, scale,
      num_decodes, decode_query_len, kv_bounds, window, softcap, sinks, kernel, k_scale=1.0,
      v_scale=1.0, auto=False):
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])


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
                  num_heads: int, num_kv_heads: int, kernel: str, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
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
    k_scale, v_scale : float
        As in `write_kv`.

    Returns
    -------
    torch.Tensor
        [T, H, D] rotated queries, contiguous, in qkv's dtype.
    """
    t, d = qkv.shape[0], _check_qkv(qkv, inv_freq, num_heads, num_kv_heads)
    kind = resolve_kernel(kernel, qkv.device)
    if kind != "triton":
        qk = apply_rope(qkv[:, : (num_heads + num_kv_heads) * d].view(t, -1, d),
                        *cos_sin(positions, inv_freq))
        write_kv(qk[:, num_heads:], qkv[:, (num_heads + num_kv_heads) * d:].view(
            t, num_kv_heads, d), k_cache, v_cache, slot_mapping, kind, k_scale, v_scale)
        return qk[:, :num_heads].contiguous()
    return launch_rope_write_kv(qkv, positions, inv_freq, k_cache, v_cache, slot_mapping,
                                num_heads, num_kv_heads, (k_scale, v_scale))


@rope_write_kv.register_fake
def _(qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
      kernel, k_scale=1.0, v_scale=1.0):
    return qkv.new_empty(qkv.shape[0], num_heads, 2 * inv_freq.shape[0])


@torch.library.custom_op("graphattn::rope_paged_attention", mutates_args=("k_cache", "v_cache"))
def rope_paged_attention(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                         block_table: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                         num_heads: int, num_kv_heads: int, num_decodes: int,
                         decode_query_len: int, kv_bounds: torch.Tensor, window: int,
                         softcap: float, sinks: torch.Tensor | None, kernel: str,
                         k_scale: float = 1.0, v_scale: float = 1.0,
                         auto: bool = False) -> torch.Tensor:
    """`rope_write_kv` then `paged_attention`, fused for a batch of one-token decode rows.

    The path is chosen here, when the op runs, from the plan's ints, so a compiled caller
    holds one call for decode and mixed batches (one compile serves both). A batch whose
    rows are all one-token decodes (``num_decodes == rows`` and ``decode_query_len == 1``)
    runs on CUDA (Triton; a power-of-two head_dim >= 16 for K and V) in one launch (plus
    the split merge) instead of two: every program rotates its queries, each row's last KV
    split rotates the new key, writes it and the value to their slot and seeds its softmax
    with them from registers; every split reads the cache below the new position only.
    Other batches run the two ops; with `auto`, so do decode batches where fusing does not
    pay (`graphattn.backends.launch_config.fuse_rope_decode` of `kv_bounds`' length: no
    specialization on the length bucket either).

    Parameters
    ----------
    qkv : [T, (H + 2 Hkv) * D]
        Rows own contiguous token ranges; tokens past the last row: padding, output 0.
    positions, inv_freq, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads
        As in `rope_write_kv` (caches written in place).
    query_start_loc, seq_lens (the new tokens counted), block_table, scale, num_decodes,
    decode_query_len, kv_bounds, window, softcap, sinks, kernel, k_scale, v_scale
        As in `paged_attention`.
    auto : bool
        Fuse only where it pays (default: wherever the kernel can).

    Returns
    -------
    torch.Tensor
        [T, H, D] in qkv's dtype; 0 for padded tokens.
    """
    t, d = qkv.shape[0], _check_qkv(qkv, inv_freq, num_heads, num_kv_heads)
    max_len, fused = _decode_launch("qkv", qkv, d, k_cache, v_cache, block_table.shape[0],
                                    num_decodes, decode_query_len, kv_bounds, kernel, auto)
    if fused:
        check_contiguous_caches("rope_paged_attention", k_cache, v_cache)
        qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
        q, k, v = qkv.view(t, -1, d).split([num_heads, num_kv_heads, num_kv_heads], 1)
        return triton_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                scale, 1, max_len, window, softcap, sinks,
                                append=Append(k, v, slot_mapping, positions, inv_freq),
                                scales=(k_scale, v_scale))
    q = rope_write_kv(qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, num_heads,
                      num_kv_heads, kernel, k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                           slot_mapping, scale, num_decodes, decode_query_len, kv_bounds,
                           window, softcap, sinks, kernel, k_scale, v_scale)


def _decode_launch(name: str, x: torch.Tensor, d: int, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, rows: int, num_decodes: int, decode_query_len: int,
                   kv_bounds: torch.Tensor, kernel: str, auto: bool) -> tuple[int, bool]:
    """(max_len, fused) of `append_paged_attention` / `rope_paged_attention` from CPU numbers:
    fused when every row is a one-token decode and the Triton launch can write the new K/V
    (head_dim `d`; with `auto`, only where it pays). ValueError, naming `name`, when `x` has
    fewer tokens than the decode rows."""
    t = x.shape[0]
    if t < num_decodes * decode_query_len:
        raise ValueError(f"{name} has {t} tokens, expected >= {num_decodes * decode_query_len} "
                         f"(num_decodes = {num_decodes} x decode_query_len = "
                         f"{decode_query_len})")
    max_len = _read_bounds(kv_bounds)[1]
    fused = (rows > 0 and num_decodes == rows and decode_query_len == 1
             and resolve_kernel(kernel, x.device) == "triton"
             and rope_fusable(d, k_cache, v_cache)
             and (not auto or fuse_rope_decode(rows, k_cache.shape[2], d, max_len, x.device,
                                               kernel)))
    return max_len, fused


@rope_paged_attention.register_fake
def _(qkv, positions, inv_freq, k_cache, v_cache, query_start_loc, seq_lens, block_table,
      slot_mapping, scale, num_heads, num_kv_heads, num_decodes, decode_query_len, kv_bounds,
      window, softcap, sinks, kernel, k_scale=1.0, v_scale=1.0, auto=False):
    return qkv.new_empty(qkv.shape[0], num_heads, 2 * inv_freq.shape[0])
