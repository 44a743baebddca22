"""Plain-torch attention pieces shared by the backends; fixed shapes, no host reads.

KV caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``; the last
block is a sink that padded tokens (slot -1) write into, so a padded row
writes nowhere a request can read.
"""

from __future__ import annotations

import torch
from einops import rearrange

__all__ = [
    "FP8_MAX",
    "fp8_scales",
    "layer_scales",
    "allocate_kv_cache",
    "is_fp8",
    "to_cache_values",
    "cascade_paged_attention",
    "shared_prefix_bounds",
    "cache_slots",
    "gather_paged",
    "gather_positions",
    "grouped_attention",
    "merge_attention",
    "token_positions",
    "token_request_index",
    "block_count",
    "write_to_cache",
]


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeroed cache of ``num_blocks + 1`` blocks (the extra one is the sink).

    Returns
    -------
    torch.Tensor
        [num_blocks + 1, block_size, num_kv_heads, head_dim].
    """
    if min(num_blocks, block_size, num_kv_heads, head_dim) < 1:
        raise ValueError(
            f"cache dims must be >= 1, got blocks={num_blocks} block_size={block_size} "
            f"heads={num_kv_heads} head_dim={head_dim}"
        )
    return torch.zeros(num_blocks + 1, block_size, num_kv_heads, head_dim, dtype=dtype,
                       device=device)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def is_fp8(dtype: torch.dtype) -> bool:
    """An 8-bit float KV-cache dtype (float8_e4m3fn: values stored as value / scale)."""
    return dtype == torch.float8_e4m3fn


def cache_dtype(kv_cache_dtype: torch.dtype | str | None, model_dtype: torch.dtype,
                ) -> torch.dtype:
    """The KV-cache dtype of an `allocate_caches(..., kv_cache_dtype)`: the model's for None,
    float8_e4m3fn for "fp8_e4m3" (or "fp8", or the dtype itself), else as given."""
    if kv_cache_dtype is None:
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if not isinstance(kv_cache_dtype, torch.dtype) or not (
            kv_cache_dtype.is_floating_point):
        raise ValueError(f"kv_cache_dtype = {kv_cache_dtype!r}, expected None, 'fp8_e4m3' or a "
                         "floating torch dtype")
    return kv_cache_dtype


def fp8_scales(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[float, float]:
    """Per-tensor fp8 scales that fit what a model-dtype cache holds: (max |K|, max |V|)
    over its blocks (the sink excluded) / 448, so the largest value stored is the format's
    largest and small values stay clear of its subnormals (1 for an empty cache). Reads the
    device on the host: a calibration step, never part of a serving step."""
    if is_fp8(k_cache.dtype) or is_fp8(v_cache.dtype):
        raise ValueError(f"fp8_scales reads a model-dtype cache, got {k_cache.dtype} / "
                         f"{v_cache.dtype} (calibrate before allocating the fp8 one)")
    amax = torch.stack([k_cache[:-1].abs().amax(), v_cache[:-1].abs().amax()]).float()
    k, v = (amax / FP8_MAX).tolist()
    return (k if k > 0 else 1.0), (v if v > 0 else 1.0)


def layer_scales(kv_scales: object, num_layers: int,
                 fp8: bool) -> tuple[tuple[float, float], ...]:
    """Per-layer (k_scale, v_scale) of `allocate_caches(..., kv_scales=...)`: None (1 for
    every layer), one pair for every layer, or one pair per layer; ValueError naming what
    was given unless each scale is a positive number and the cache is fp8."""
    if kv_scales is None:
        return ((1.0, 1.0),) * num_layers
    if not fp8:
        raise ValueError("kv_scales are an fp8 cache's: pass kv_cache_dtype='fp8_e4m3' too")
    pairs = list(kv_scales)  # type: ignore[call-overload]
    if len(pairs) == 2 and all(isinstance(x, (int, float)) for x in pairs):
        pairs = [pairs] * num_layers
    ok = len(pairs) == num_layers and all(
        len(p) == 2 and all(isinstance(x, (int, float)) and x > 0 for x in p) for p in pairs)
    if not ok:
        raise ValueError(f"kv_scales = {kv_scales!r}, expected a positive (k_scale, v_scale) "
                         f"pair or {num_layers} of them (one per layer)")
    return tuple((float(k), float(v)) for k, v in pairs)


def to_cache_values(values: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`values` as a cache of `dtype` stores them: for an fp8 cache value / scale, clamped
    to the finite range (the scale's dequantization is the reader's); otherwise as given."""
    if not is_fp8(dtype):
        return values
    return (values.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def write_to_cache(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor,
                   scale: float = 1.0) -> None:
    """Write ``values[i]`` to slot ``slot_mapping[i]``; slot -1 goes to the sink; an fp8
    cache stores ``values / scale`` (`to_cache_values`).

    Parameters
    ----------
    cache : torch.Tensor
        [num_blocks, block_size, heads, dim], written in place.
    slot_mapping : torch.Tensor
        int64 [>= n] flat slot per token.
    values : torch.Tensor
        [n, heads, dim].
    """
    flat = cache.view(-1, *cache.shape[2:])
    n = values.shape[0]
    if slot_mapping.shape[0] < n:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries, expected >= {n}")
    slots = slot_mapping[:n]
    sink = flat.shape[0] - 1
    idx = torch.where(slots >= 0, slots, torch.full_like(slots, sink))
    vals = to_cache_values(values, flat.dtype, scale).to(flat.dtype)
    if is_fp8(flat.dtype):  # CPU index_copy_ has no fp8 kernel: copy the bytes
        flat, vals = flat.view(torch.uint8), vals.view(torch.uint8)
    flat.index_copy_(0, idx, vals)


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The first `num_blocks` blocks of each row, as contiguous positions.

    Returns
    -------
    torch.Tensor
        [rows, num_blocks * block_size, heads, dim]; position p of row r is
        at index p.
    """
    if not 1 <= num_blocks <= block_table.shape[1]:
        raise ValueError(f"num_blocks = {num_blocks}, expected in [1, {block_table.shape[1]}]")
    return _take(cache, block_table[:, :num_blocks].long()).flatten(1, 2)


def gather_positions(cache: torch.Tensor, block_table: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Entries at arbitrary positions of each row.

    Parameters
    ----------
    cache : torch.Tensor
        [num_blocks, block_size, heads, dim].
    block_table : torch.Tensor
        int [rows, max_blocks].
    positions : torch.Tensor
        int [rows, W]; clamped into the row's table (mask the result yourself).

    Returns
    -------
    torch.Tensor
        [rows, W, heads, dim].
    """
    return _take(cache.view(-1, *cache.shape[2:]),
                 cache_slots(block_table, positions, cache.shape[1]))


def _take(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]``, through a byte view for fp8 caches (no fp8 gather on every device)."""
    if is_fp8(cache.dtype):
        return cache.view(torch.uint8)[index].view(cache.dtype)
    return cache[index]


def cache_slots(block_table: torch.Tensor, positions: torch.Tensor,
                block_size: int) -> torch.Tensor:
    """int64 [rows, W]: the cache slot (block * block_size + offset) of each row's positions
    (int [rows, W], clamped into the row's table) through block_table (int [rows, blocks])."""
    pos = positions.long().clamp(0, block_table.shape[1] * block_size - 1)
    return torch.gather(block_table.long(), 1, pos // block_size) * block_size + pos % block_size


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    req: torch.Tensor) -> torch.Tensor:
    """int64 [T]: sequence position of each token (query tokens are the last of the row)."""
    t = torch.arange(req.shape[0], device=req.device)
    return (seq_lens[req] - (query_start_loc[req + 1] - t)).long()


def block_count(max_len: int, block_size: int, max_blocks: int) -> int:
    """Blocks that hold `max_len` positions, in [1, max_blocks]."""
    return min(max(-(-max_len // block_size), 1), max_blocks)


def token_request_index(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int64 [num_tokens]: row of each token (tokens past the last row: the last row)."""
    rows = query_start_loc.shape[0] - 1
    t = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    idx = torch.searchsorted(query_start_loc[1:].contiguous(), t, right=True)
    return idx.clamp_(max=max(rows - 1, 0)).long()


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _masked_scores(q: torch.Tensor, k: torch.Tensor, key_hi: torch.Tensor,
                   key_lo: torch.Tensor | None, scale: float, softcap: float) -> torch.Tensor:
    """Scaled (soft-capped) scores [B, Hkv, G, N, L], -inf outside each query's key window."""
    qg = rearrange(q, "b n (k g) d -> b k g n d", k=k.shape[2])
    scores = torch.einsum("bkgnd,blkd->bkgnl", qg, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(k.shape[1], device=q.device)
    mask = pos < key_hi.unsqueeze(-1)
    if key_lo is not None:
        mask &= pos >= key_lo.unsqueeze(-1)
    return scores.masked_fill(~mask[:, None, None], float("-inf"))


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_hi: torch.Tensor,
    key_lo: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped queries over per-group keys with key windows.

    Query n of group b sees keys l with ``key_lo[b, n] <= l < key_hi[b, n]``;
    a query that sees none gets output 0 and lse -inf.

    Parameters
    ----------
    q : torch.Tensor
        [B, N, H, D].
    k : torch.Tensor
        [B, L, Hkv, D], H a multiple of Hkv (query head h uses kv head h // (H / Hkv)).
    v : torch.Tensor
        [B, L, Hkv, Dv].
    key_hi, key_lo : torch.Tensor
        int [B, N].
    scale : float, optional
        Default D ** -0.5.
    softcap : float
        Scores become ``softcap * tanh(scores / softcap)`` (0: unchanged).
    sinks : torch.Tensor, optional
        [H] per-head sink logits: each softmax denominator gains exp(sink).

    Returns
    -------
    out : torch.Tensor
        [B, N, H, Dv] in q's dtype.
    lse : torch.Tensor
        [B, N, H] float32 (float64 for float64 inputs), natural log.
    """
    b, n, h, d = q.shape
    hkv = k.shape[2]
    if h % hkv:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {hkv}")
    cdt = _compute_dtype(q)
    scores = _masked_scores(q.to(cdt), k.to(cdt), key_hi, key_lo,
                            d ** -0.5 if scale is None else scale, softcap)
    m = scores.amax(-1, keepdim=True)
    sink = None
    if sinks is not None:
        sink = sinks.to(cdt).view(1, hkv, h // hkv, 1, 1)
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    s = p.sum(-1, keepdim=True)
    if sink is not None:
        s = s + torch.exp(sink - m)
    out = torch.einsum("bkgnl,blkd->bkgnd", p, v.to(cdt)) / s.clamp_min(torch.finfo(cdt).tiny)
    lse = (torch.log(s) + m).squeeze(-1)
    out = rearrange(out, "b k g n d -> b n (k g) d").to(q.dtype)
    return out, rearrange(lse, "b k g n -> b n (k g)")


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets by their log-sum-exp.

    Parameters
    ----------
    out_a, out_b : torch.Tensor
        [..., H, Dv].
    lse_a, lse_b : torch.Tensor
        [..., H].
    """
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = wa + wb
    cdt = lse_a.dtype
    out = (out_a.to(cdt) * wa.unsqueeze(-1) + out_b.to(cdt) * wb.unsqueeze(-1)) / (
        total.clamp_min(torch.finfo(cdt).tiny).unsqueeze(-1)
    )
    return out.to(out_a.dtype), m + torch.log(total)


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


def shared_prefix_bounds(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, t: int,
                         window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each of `t` tokens' keys, for the two passes of shared-prefix attention.

    Returns
    -------
    req : int64 [T], each token's row
    hi : int64 [T], the token's last key + 1 (0 for a padded token)
    lo : int64 [T], its window's first key (0 without a window)
    """
    req = token_request_index(query_start_loc, t)
    pos = token_positions(query_start_loc, seq_lens, req)
    real = torch.arange(t, device=pos.device) < query_start_loc[-1]
    hi = torch.where(real, pos + 1, 0)
    lo = (hi - window).clamp(min=0) if window > 0 else torch.zeros_like(hi)
    return req, hi, lo


def cascade_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, slot_mapping: torch.Tensor, scale: float,
                            num_kv_blocks: int, shared_rows: torch.Tensor, shared_prefix: int,
                            window: int = 0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Shared-prefix attention in plain torch (the reference and CPU path of
    ``torch.ops.graphattn.cascade_attention``): the prefix's KV gathered once, through the
    first group row's block table, for every token of the group; each token's own keys from
    the prefix's end on (from 0 outside the group); the two merged by log-sum-exp."""
    bs = k_cache.shape[1]
    req, hi, lo = shared_prefix_bounds(query_start_loc, seq_lens, q.shape[0], window)
    member = shared_rows.long()[req] > 0
    leader = block_table.index_select(0, shared_rows.long().argmax().view(1))
    nbp = shared_prefix // bs
    kp, vp = gather_paged(k_cache, leader, nbp), gather_paged(v_cache, leader, nbp)
    extra = dict(scale=scale, softcap=softcap)
    o_p, lse_p = grouped_attention(q[None], kp, vp, torch.where(member, hi.clamp(
        max=shared_prefix), 0)[None], lo[None], **extra)
    start = torch.maximum(lo, torch.where(member, shared_prefix, 0))
    kc = gather_paged(k_cache, block_table, num_kv_blocks)[req]
    vc = gather_paged(v_cache, block_table, num_kv_blocks)[req]
    o_s, lse_s = grouped_attention(q[:, None], kc, vc, hi[:, None], start[:, None],
                                   sinks=sinks, **extra)
    return merge_attention(o_p[0], lse_p[0], o_s[:, 0], lse_s[:, 0])[0]
