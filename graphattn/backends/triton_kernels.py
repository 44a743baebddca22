"""Triton kernels for paged attention (CUDA only; launched by `graphattn.backends.triton_launch`).

One unified kernel serves decode, spec-decode verify and prefill rows in any
mix: a program owns a tile of BLOCK_Q query tokens of one row times the G
query heads of one KV head (GQA is packed into the M axis of the tile), reads
K/V straight through the block table in the cache dtype, accumulates in
fp32 with an online softmax, and optionally (SPLIT) cuts each row's KV range
into num_splits equal segments (from the row's device length) merged by their
log-sum-exp.

Every launch parameter (grid, tile sizes, splits) comes from CPU numbers
(padded sizes and the key's length bucket); the loop bounds come from the
device `seq_lens`, so an over-estimating bound costs grid, never bytes.

Integer arguments that change from one graph key to the next (row, token and split
counts) are not specialized (``do_not_specialize``): Triton would otherwise compile a
kernel again whenever one of them turns 1 or a multiple of 16, once per such key at
capture, for no faster code (they bound loops and masks, never an alignment).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

__all__ = ["indexer_scores_kernel", "merge_splits_kernel", "rope_write_kv_kernel",
           "shared_prefix_kernel", "unified_attention_kernel", "write_kv_kernel"]


@triton.jit
def _find_row(query_start_loc, num_rows, tile, BLOCK_Q: tl.constexpr):
    """Row whose tiles hold `tile` (tile r's first index is qsl[r] // BLOCK_Q + r)."""
    lo = 0
    hi = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _log2_logits(s, scale, softcap, USE_SOFTCAP: tl.constexpr):
    """Scaled (and soft-capped: cap * tanh(s * scale / cap)) logits in log2 units."""
    if USE_SOFTCAP:
        x = s * (scale / softcap)
        return softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * 1.4426950408889634
    return s * (scale * 1.4426950408889634)


@triton.jit
def _cos_sin(ang):
    """cos and sin of float32 angles: reduced to [-pi, pi] by 2 pi in three parts (Cody-Waite;
    6.25 and 17 / 512 have 5 significant bits, so k times them and the first two differences
    are exact while k < 2**19, angles below 3e6), then the hardware approximations (abs error
    about 1e-6 there). libdevice's precise cos/sin keep a 32-byte stack per thread (their
    Payne-Hanek branch; `python -m bench.triton_compile_check`)."""
    k = tl.floor(ang * 0.15915494309189535 + 0.5)
    x = tl.fma(k, -6.25, ang)
    x = tl.fma(k, -0.033203125, x)
    x = tl.fma(k, 1.781781975296326e-05, x)
    return libdevice.fast_cosf(x), libdevice.fast_sinf(x)


@triton.jit
def _rotate(x1, x2, c, s, dtype: tl.constexpr):
    """NeoX rotation of the halves (x1, x2) by angles with cosine c and sine s, in float32,
    rounded to `dtype`."""
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return (x1 * c - x2 * s).to(dtype), (x2 * c + x1 * s).to(dtype)


@triton.jit
def _to_cache(x, scale, dtype: tl.constexpr, FP8: tl.constexpr):
    """`x` as a cache of `dtype` stores it: an fp8 cache x / scale (IEEE division, as torch),
    clamped to e4m3's finite range; otherwise x rounded to `dtype`."""
    if FP8:
        x = tl.math.div_rn(x.to(tl.float32), scale)
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    return x.to(dtype)


@triton.jit
def _tile_pages(block_table, row_table, offs_n, seg_lo, stop, PAGE: tl.constexpr):
    """The pages of keys `offs_n` in a row's block table (`row_table`: its first entry),
    0 for keys outside [seg_lo, stop)."""
    return tl.load(block_table + row_table + offs_n // PAGE,
                   mask=(offs_n < stop) & (offs_n >= seg_lo), other=0)


@triton.jit
def _tile_logits(qv, k_cache, page, slot, k_head, stride_kb, stride_ks, offs_d, n_ok, d_ok,
                 scale, softcap, USE_SOFTCAP: tl.constexpr):
    """Logits (log2 units) of the queries `qv` against one tile of keys read through `page`
    and `slot` (the key dtype converted to the queries': an fp8 cache dequantized here)."""
    kt = tl.load(k_cache + page[None, :] * stride_kb + slot[None, :] * stride_ks + k_head
                 + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    return _log2_logits(tl.dot(qv, kt.to(qv.dtype)), scale, softcap, USE_SOFTCAP)


@triton.jit
def _online_softmax_tile(s, m_i, l_i, acc, qv, v_cache, page, slot, v_head, stride_vb,
                         stride_vs, offs_dv, n_ok, dv_ok):
    """One tile of the online softmax: masked logits `s` update the running max `m_i`, sum
    `l_i` and output `acc` with the tile's values; returns the three."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    vv = tl.load(v_cache + page[:, None] * stride_vb + slot[:, None] * stride_vs + v_head
                 + offs_dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
    if v_cache.dtype.element_ty.is_fp8():
        # widened here, the mask after it pinning it: left to the dot, the compiler widens
        # after the shared-memory load, which reads the 8-bit tile (keys strided) a byte
        # at a time; widened first, the tile is copied 16 bytes at a time and the 16-bit
        # operand loads with ldmatrix.trans (bench.triton_compile_check)
        vv = tl.where(n_ok[:, None], vv.to(qv.dtype), 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(qv.dtype), vv.to(qv.dtype))
    return m_new, l_i, acc


@triton.jit
def _fold_partial(m_i, l_i, acc, part_out, part_lse, at, m_ok, offs_dv, dv_ok,
                  DV_PAD: tl.constexpr):
    """Fold the normalized partial at `at` (output part_out[at], log2-sum-exp part_lse[at])
    into a running softmax (m_i, l_i in log2 units, unnormalized acc); returns the three."""
    lse = tl.load(part_lse + at, mask=m_ok, other=float("-inf"))
    o = tl.load(part_out + at[:, None] * DV_PAD + offs_dv[None, :],
                mask=(m_ok & (lse > float("-inf")))[:, None] & dv_ok[None, :], other=0.0)
    m_new = tl.maximum(m_i, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    w = tl.exp2(lse - m_safe)
    return m_new, l_i * alpha + w, acc * alpha[:, None] + w[:, None] * o


@triton.jit(do_not_specialize=("num_rows", "num_tokens", "num_splits", "num_parts",
                                "part_base"))
def unified_attention_kernel(
    out, part_out, part_lse,
    q, k_cache, v_cache, block_table, seq_lens, query_start_loc, sinks,
    k_new, v_new, positions, inv_freq, slot_mapping, kv_start, counters,
    scale, softcap, window, k_scale, v_scale,
    num_rows, num_heads, num_tokens, num_splits, num_parts, part_base,
    stride_qt, stride_qh, stride_nkt, stride_nkh, stride_nvt, stride_nvh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    G: tl.constexpr, G_TILE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, UNIFORM: tl.constexpr, SPLIT: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr,
    USE_PDL: tl.constexpr, APPEND: tl.constexpr, ROTATE: tl.constexpr,
    USE_KV_START: tl.constexpr, FP8: tl.constexpr, PREFIX_PARTS: tl.constexpr,
    MERGE: tl.constexpr, MERGE_CHUNK: tl.constexpr, PREFETCH_PAGES: tl.constexpr,
):
    """Program (tile x head group, KV head, split) takes G_TILE of the G query heads of its
    KV head (all G unless the tile would not fit: MLA's 128 latent heads).

    `scale` includes an fp8 cache's K scale; `v_scale` (1 otherwise) multiplies the
    output (partials too: their merge is a convex sum). FP8: the rotary append stores the
    new K / V as K / k_scale and V / v_scale (`_to_cache`) and seeds from those values.

    USE_KV_START: each row reads keys from ``kv_start[row]`` on (the suffix pass of
    shared-prefix attention). SPLIT: split i writes its partial at part ``part_base + i`` of
    `num_parts` per (token, head) (the suffix pass fills the parts after the prefix's).
    PREFIX_PARTS > 0 (unsplit suffix passes): the softmax starts from parts 0 ..
    PREFIX_PARTS - 1 of `num_parts` (the prefix pass's), so the output is final.
    MERGE > 0 (with SPLIT; a power of two >= num_splits): the splits of a (tile, head
    group, KV head) count themselves on ``counters[program_id(0) * num_programs(1) +
    program_id(1)]`` (int32, 0 before the launch) after writing their partials; the last
    one folds every partial into the output (and the sinks), MERGE_CHUNK splits a load,
    and puts the counter back to 0, so no merge kernel runs.
    PREFETCH_PAGES: each iteration loads the next key tile's block-table entries, so the
    K/V tiles' addresses are loop-carried and the software pipeline can buffer
    ``num_stages - 1`` K/V tiles (`TritonConfig.prefetch_pages`).

    APPEND (one-token decode rows, UNIFORM with BLOCK_Q 1, HEAD_DIM a power of two equal
    to HEAD_DIM_V): each token's new key and value are `k_new` / `v_new` [T, Hkv, D]; the
    row's last split writes them to slot ``slot_mapping[t]`` and seeds its softmax with
    them from registers, and every split reads the cache below the new position only (no
    program reads a slot another writes). ROTATE (with APPEND): q and the new key are
    rotated here first (NeoX halves, angle positions[t] * inv_freq)."""
    if USE_PDL:  # launched early: the previous kernel done and flushed before any access
        tl.extra.cuda.gdc_wait()
    # the head groups of a tile are neighbours in launch order: they run together and read
    # the same K / V tiles while those are in L2
    tile = tl.program_id(0) // (G // G_TILE)
    kvh = tl.program_id(1)
    h0 = kvh * G + tl.program_id(0) % (G // G_TILE) * G_TILE  # first query head it takes
    split = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, DV_PAD)
    dv_ok = offs_dv < HEAD_DIM_V
    if MERGE or not SPLIT:
        # tokens past the last row's belong to no row; tile i zeroes those in its own range
        # [i * BLOCK_Q, (i + 1) * BLOCK_Q) (the grid covers every token), so the output
        # needs no fill first
        zt = tile * BLOCK_Q + offs_m // G_TILE
        zm = ((offs_m < BLOCK_Q * G_TILE) & (zt >= tl.load(query_start_loc + num_rows))
              & (zt < num_tokens) & (split == 0))
        tl.store(out + zt[:, None] * stride_ot + (h0 + offs_m % G_TILE)[:, None] * stride_oh
                 + offs_dv[None, :], tl.zeros([BLOCK_M, DV_PAD], out.dtype.element_ty),
                 mask=zm[:, None] & dv_ok[None, :])
    if UNIFORM:  # every row fits one tile: program i owns row i (no search, no empty tiles)
        if tile >= num_rows:
            return
        row = tile
        local = 0
    else:
        row = _find_row(query_start_loc, num_rows, tile, BLOCK_Q)
        local = tile - (tl.load(query_start_loc + row) // BLOCK_Q + row)
    q_start = tl.load(query_start_loc + row)
    q_len = tl.load(query_start_loc + row + 1) - q_start
    seq_len = tl.load(seq_lens + row)
    if local * BLOCK_Q >= q_len:
        return
    ctx = seq_len - q_len

    t = local * BLOCK_Q + offs_m // G_TILE  # query token of the row
    head = h0 + offs_m % G_TILE
    m_ok = (offs_m < BLOCK_Q * G_TILE) & (t < q_len)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    tok = q_start + t
    q_rows = q + tok[:, None] * stride_qt + head[:, None] * stride_qh
    pos = ctx + t  # causal: query at position pos sees keys [lo, pos]
    kv_hi = tl.minimum(ctx + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len), seq_len)
    if APPEND:  # head_dim == D_PAD here: halves load contiguous, no mask along them
        half: tl.constexpr = HEAD_DIM // 2
        offs_h = tl.arange(0, half)
        q1 = tl.load(q_rows + offs_h[None, :], mask=m_ok[:, None], other=0.0)
        q2 = tl.load(q_rows + half + offs_h[None, :], mask=m_ok[:, None], other=0.0)
        k_at = k_new + q_start * stride_nkt + kvh * stride_nkh
        k1 = tl.load(k_at + offs_h).to(q.dtype.element_ty)
        k2 = tl.load(k_at + half + offs_h).to(q.dtype.element_ty)
        if ROTATE:
            ang = tl.load(positions + q_start).to(tl.float32) * tl.load(inv_freq + offs_h)
            c, sn = _cos_sin(ang)
            q1, q2 = _rotate(q1, q2, c[None, :], sn[None, :], q.dtype.element_ty)
            k1, k2 = _rotate(k1, k2, c, sn, q.dtype.element_ty)
        qv = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_M, D_PAD))
        k1 = _to_cache(k1, k_scale, k_cache.dtype.element_ty, FP8)
        k2 = _to_cache(k2, k_scale, k_cache.dtype.element_ty, FP8)
        v_row = _to_cache(tl.load(v_new + q_start * stride_nvt + kvh * stride_nvh + offs_dv,
                                  mask=dv_ok, other=0.0).to(q.dtype.element_ty), v_scale,
                          v_cache.dtype.element_ty, FP8)
        last = split == num_splits - 1
        new_slot = tl.load(slot_mapping + q_start)
        w_ok = last & (new_slot >= 0) & (h0 == kvh * G)  # one head group writes
        k_to = k_cache + new_slot // PAGE * stride_kb + new_slot % PAGE * stride_ks \
            + kvh * stride_kh
        tl.store(k_to + offs_h, k1, mask=w_ok)
        tl.store(k_to + half + offs_h, k2, mask=w_ok)
        tl.store(v_cache + new_slot // PAGE * stride_vb + new_slot % PAGE * stride_vs
                 + kvh * stride_vh + offs_dv, v_row, mask=dv_ok & w_ok)
        s_new = tl.sum(q1.to(tl.float32) * k1.to(tl.float32)[None, :], 1) + tl.sum(
            q2.to(tl.float32) * k2.to(tl.float32)[None, :], 1)
        kv_hi = ctx  # the new position comes from registers
    else:
        qv = tl.load(q_rows + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8 and q.dtype.element_ty == tl.bfloat16:
        # an fp8 cache under bf16 queries: the dots run in fp16, which e4m3 converts to in
        # one instruction (to bf16 it takes several), and which holds queries, fp8 K / V
        # and the probabilities
        qv = qv.to(tl.float16)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx + local * BLOCK_Q - window + 1, 0)
    if USE_KV_START:
        kv_lo = tl.maximum(kv_lo, tl.load(kv_start + row))
    if not SPLIT:
        seg_lo = kv_lo
        stop = kv_hi
    else:
        # the row's own key range in num_splits equal parts (whole BLOCK_N tiles): the
        # split count comes from CPU bounds, the parts from the device length, so an
        # over-estimated bucket costs empty programs, never a longer critical path
        part = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_splits), BLOCK_N) * BLOCK_N
        seg_lo = kv_lo + split * part
        stop = tl.minimum(kv_hi, seg_lo + part)
    start = seg_lo // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    if APPEND:  # the softmax starts from the new key (last split), so nothing of it
        # stays live through the loop
        m_i = tl.where(m_ok & last, _log2_logits(s_new, scale, softcap, USE_SOFTCAP),
                       float("-inf"))
        l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
        acc = l_i[:, None] * v_row.to(tl.float32)[None, :]
    for part_i in tl.static_range(PREFIX_PARTS):
        m_i, l_i, acc = _fold_partial(
            m_i, l_i, acc, part_out, part_lse, (tok * num_heads + head) * num_parts + part_i,
            m_ok, offs_dv, dv_ok, DV_PAD)
    if PREFETCH_PAGES:  # the first tile's pages; each iteration loads the next tile's
        page_next = _tile_pages(block_table, row * stride_bt, start + tl.arange(0, BLOCK_N),
                                seg_lo, stop, PAGE)
    for n0 in range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = (offs_n < stop) & (offs_n >= seg_lo)
        if PREFETCH_PAGES:
            page = page_next
            page_next = _tile_pages(block_table, row * stride_bt, offs_n + BLOCK_N, seg_lo,
                                    stop, PAGE)
        else:
            page = _tile_pages(block_table, row * stride_bt, offs_n, seg_lo, stop, PAGE)
        slot = offs_n % PAGE
        s = _tile_logits(qv, k_cache, page, slot, kvh * stride_kh, stride_kb, stride_ks,
                         offs_d, n_ok, d_ok, scale, softcap, USE_SOFTCAP)
        vis = m_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        if USE_WINDOW:
            vis = vis & (offs_n[None, :] > pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_tile(
            tl.where(vis, s, float("-inf")), m_i, l_i, acc, qv, v_cache, page, slot,
            kvh * stride_vh, stride_vb, stride_vs, offs_dv, n_ok, dv_ok)

    # m_i, l_i are in log2 units from here on
    final = not SPLIT
    o_scale = v_scale
    if SPLIT:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
        lse2 = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
        base = (tok * num_heads + head) * num_parts + part_base
        tl.store(part_out + (base + split)[:, None] * DV_PAD + offs_dv[None, :], o,
                 mask=m_ok[:, None] & dv_ok[None, :])
        tl.store(part_lse + base + split, lse2, mask=m_ok)
        if MERGE:
            final, m_i, l_i, acc = _merge_own_splits(
                part_out, part_lse, counters, base, num_splits, m_ok, offs_dv, dv_ok, DV_PAD,
                MERGE, MERGE_CHUNK)
            o_scale = 1.0  # the partials carry v_scale
    if final:
        if USE_SINKS:
            sink = tl.load(sinks + head, mask=m_ok, other=float("-inf")) * 1.4426950408889634
            m_tot = tl.maximum(m_i, sink)
            m_tot = tl.where(m_tot == float("-inf"), 0.0, m_tot)
            l_i = l_i * tl.exp2(m_i - m_tot) + tl.exp2(sink - m_tot)
            acc = acc * tl.exp2(m_i - m_tot)[:, None]
            m_i = m_tot
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * o_scale
        tl.store(out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
                 o.to(out.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])


@triton.jit
def _merge_own_splits(part_out, part_lse, counters, base, num_splits, m_ok, offs_dv, dv_ok,
                      DV_PAD: tl.constexpr, S_PAD: tl.constexpr, S_CHUNK: tl.constexpr):
    """Count this split done on its program's counter; the last split of the launch (every
    partial written and visible: release / acquire at GPU scope after a CTA barrier) folds
    the `num_splits` (<= S_PAD) partials at ``base + i`` and resets the counter. Returns
    (whether this program is the last, m, l, acc): the partials' softmax in log2 units.

    The fold reads every LSE in one load, then the outputs S_CHUNK splits a load with
    their weights known, so no load waits on the one before (a split at a time, one L2
    round trip each, it cost more than the merge kernel's launch). Loads skip L1 (".cg"):
    other programs of the launch wrote them."""
    ctr = counters + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.debug_barrier()  # every thread's partial stores before the release
    ticket = tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu")
    last = ticket == num_splits - 1
    m = tl.full(base.shape, float("-inf"), tl.float32)
    l_i = tl.zeros(base.shape, tl.float32)
    acc = tl.zeros((base.shape[0], DV_PAD), tl.float32)
    if last:
        tl.store(ctr, 0)
        offs_s = tl.arange(0, S_PAD)
        lse = tl.load(part_lse + base[None, :] + offs_s[:, None],
                      mask=(offs_s < num_splits)[:, None] & m_ok[None, :],
                      other=float("-inf"), cache_modifier=".cg")
        m = tl.max(lse, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        l_i = tl.sum(tl.exp2(lse - m_safe[None, :]), 0)
        offs_c = tl.arange(0, S_CHUNK)
        for c in tl.static_range(0, S_PAD, S_CHUNK):
            at = base[None, :] + (c + offs_c)[:, None]
            ok = ((c + offs_c) < num_splits)[:, None] & m_ok[None, :]
            lse_c = tl.load(part_lse + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(part_out + at[:, :, None] * DV_PAD + offs_dv[None, None, :],
                        mask=(ok & (lse_c > float("-inf")))[:, :, None]
                        & dv_ok[None, None, :], other=0.0, cache_modifier=".cg")
            acc += tl.sum(tl.exp2(lse_c - m_safe[None, :])[:, :, None] * o, 0)
    return last, m, l_i, acc


@triton.jit
def _token_rows(query_start_loc, num_rows, tok, LOG_ROWS: tl.constexpr):
    """Each token's row: the last r in [0, num_rows) with query_start_loc[r] <= tok (a
    vector binary search of LOG_ROWS >= log2(num_rows) + 1 halvings)."""
    lo = tl.zeros(tok.shape, tl.int32)
    hi = tl.zeros(tok.shape, tl.int32) + num_rows
    for _ in tl.static_range(LOG_ROWS):
        mid = (lo + hi) // 2
        go = tl.load(query_start_loc + mid, mask=mid < num_rows, other=0) <= tok
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit(do_not_specialize=("num_rows", "num_tokens", "prefix_len", "num_splits",
                                "num_parts"))
def shared_prefix_kernel(
    part_out, part_lse, q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
    shared_rows, scale, softcap, window, num_rows, num_tokens, num_heads, prefix_len,
    num_splits, num_parts,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_bt,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, ROWS_PAD: tl.constexpr, LOG_ROWS: tl.constexpr, Q_LEN: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
):
    """The prefix pass of shared-prefix attention: a program owns BLOCK_M (token, head)
    pairs of one KV head and one of `num_splits` parts of the prefix, whose keys it reads
    once for all of them through the block table of the group's first row
    (``shared_rows[r] > 0``). A token of a group row at position p sees prefix keys
    [max(p + 1 - window, 0), min(p + 1, prefix_len)); other tokens none. Writes the part's
    normalized output and log2-sum-exp to part_out [t, head, num_parts, DV_PAD] / part_lse
    [t, head, num_parts] at part `split` (the parts past `num_splits`: the suffix pass's,
    merged by `merge_splits_kernel`). Q_LEN > 0: every row has Q_LEN tokens, so a token's
    row is its index // Q_LEN (no search)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_r = tl.arange(0, ROWS_PAD)
    member = tl.load(shared_rows + offs_r, mask=offs_r < num_rows, other=0) > 0
    leader = tl.minimum(tl.min(tl.where(member, offs_r, ROWS_PAD), 0), num_rows - 1)
    idx = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = idx // G
    head = kvh * G + idx % G
    in_range = tok < num_tokens
    if Q_LEN > 0:
        row = tl.minimum(tok // Q_LEN, num_rows - 1)
    else:
        row = _token_rows(query_start_loc, num_rows, tok, LOG_ROWS)
    end = tl.load(query_start_loc + row + 1)
    pos1 = tl.load(seq_lens + row) - (end - tok) + 1  # the token's position + 1
    m_ok = (in_range & (tok < tl.load(query_start_loc + num_rows))
            & (tl.load(shared_rows + row) > 0))
    hi = tl.where(m_ok, tl.minimum(pos1, prefix_len), 0)
    lo = tl.zeros([BLOCK_M], tl.int32)
    if USE_WINDOW:
        lo = tl.maximum(pos1 - window, 0)
    m_ok = m_ok & (hi > lo)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    qv = tl.load(q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                 mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    part = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
    seg_lo = split * part
    stop = tl.minimum(prefix_len, seg_lo + part)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    for n0 in range(seg_lo, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        page = tl.load(block_table + leader * stride_bt + offs_n // PAGE, mask=n_ok, other=0)
        slot = offs_n % PAGE
        s = _tile_logits(qv, k_cache, page, slot, kvh * stride_kh, stride_kb, stride_ks,
                         offs_d, n_ok, d_ok, scale, softcap, USE_SOFTCAP)
        vis = (m_ok[:, None] & n_ok[None, :] & (offs_n[None, :] < hi[:, None])
               & (offs_n[None, :] >= lo[:, None]))
        m_i, l_i, acc = _online_softmax_tile(
            tl.where(vis, s, float("-inf")), m_i, l_i, acc, qv, v_cache, page, slot,
            kvh * stride_vh, stride_vb, stride_vs, offs_dv, n_ok, dv_ok)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse2 = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
    base = (tok * num_heads + head) * num_parts + split
    tl.store(part_out + base[:, None] * DV_PAD + offs_dv[None, :], o,
             mask=in_range[:, None] & dv_ok[None, :])
    tl.store(part_lse + base, lse2, mask=in_range)


@triton.jit(do_not_specialize=("num_rows", "num_splits"))
def merge_splits_kernel(
    out, part_out, part_lse, sinks, query_start_loc, num_rows, num_heads, num_splits,
    stride_ot, stride_oh,
    HEAD_DIM_V: tl.constexpr, DV_PAD: tl.constexpr, S_PAD: tl.constexpr, USE_SINKS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[t, h] = the splits of (t, h) weighted by their softmax mass (+ the head's sink).

    Every split of a real token wrote its partial (an empty one with LSE -inf); padded
    tokens (t >= query_start_loc[num_rows]) get 0, and their partials are never read, so
    neither buffer needs filling first.
    """
    if USE_PDL:  # launched early: the attention kernel done and flushed before any access
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, DV_PAD)
    base = (t * num_heads + h) * num_splits
    real = t < tl.load(query_start_loc + num_rows)
    lse = tl.load(part_lse + base + offs_s, mask=(offs_s < num_splits) & real,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    if USE_SINKS:
        sink = tl.load(sinks + h) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    if USE_SINKS:
        total += tl.exp2(sink - m)
    written = (offs_s < num_splits) & (lse > float("-inf"))
    o = tl.load(part_out + (base + offs_s[:, None]) * DV_PAD + offs_d[None, :],
                mask=written[:, None] & (offs_d[None, :] < HEAD_DIM_V), other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out + t * stride_ot + h * stride_oh + offs_d, res.to(out.dtype.element_ty),
             mask=offs_d < HEAD_DIM_V)



@triton.jit
def write_kv_kernel(
    k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    stride_kt, stride_vt, stride_kcs, stride_vcs,
    ROW_K: tl.constexpr, ROW_V: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr,
):
    """k_cache[slot[t]] = k[t], v_cache[slot[t]] = v[t] (all heads; FP8: k / k_scale and
    v / v_scale, `_to_cache`); slot < 0: no write."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot < 0:
        return
    for i in range(0, ROW_K, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        ok = offs < ROW_K
        x = tl.load(k + t * stride_kt + offs, mask=ok)
        tl.store(k_cache + slot * stride_kcs + offs,
                 _to_cache(x, k_scale, k_cache.dtype.element_ty, FP8), mask=ok)
    for i in range(0, ROW_V, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        ok = offs < ROW_V
        x = tl.load(v + t * stride_vt + offs, mask=ok)
        tl.store(v_cache + slot * stride_vcs + offs,
                 _to_cache(x, v_scale, v_cache.dtype.element_ty, FP8), mask=ok)


@triton.jit
def rope_write_kv_kernel(
    qkv, positions, inv_freq, q_out, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    stride_qkv, stride_qo, stride_kcs, stride_vcs,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    H_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF_PAD: tl.constexpr, D_PAD: tl.constexpr,
    USE_PDL: tl.constexpr, FP8: tl.constexpr,
):
    """Token t of qkv [T, (H + 2 HKV) * D]: q rotated into q_out, k rotated and v written to
    slot ``slot_mapping[t]`` of the caches (slot < 0: not written; FP8: stored as K / k_scale
    and V / v_scale, `_to_cache`). Rotation: NeoX halves, angle = position * inv_freq in
    float32, rounded to qkv's dtype."""
    if USE_PDL:  # launched early: the previous kernel done and flushed before any access
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    half: tl.constexpr = D // 2
    i = tl.arange(0, HALF_PAD)
    i_ok = i < half
    ang = tl.load(positions + t).to(tl.float32) * tl.load(inv_freq + i, mask=i_ok, other=0.0)
    c, s = _cos_sin(ang)
    c = c[None, :]
    s = s[None, :]
    row = qkv + t * stride_qkv
    h = tl.arange(0, H_PAD)
    m = (h < H)[:, None] & i_ok[None, :]
    q_src = row + h[:, None] * D + i[None, :]
    q1, q2 = _rotate(tl.load(q_src, mask=m, other=0.0), tl.load(q_src + half, mask=m, other=0.0),
                     c, s, q_out.dtype.element_ty)
    q_dst = q_out + t * stride_qo + h[:, None] * D + i[None, :]
    tl.store(q_dst, q1, mask=m)
    tl.store(q_dst + half, q2, mask=m)
    slot = tl.load(slot_mapping + t)
    if slot >= 0:
        kh = tl.arange(0, HKV_PAD)
        km = (kh < HKV)[:, None] & i_ok[None, :]
        k_src = row + H * D + kh[:, None] * D + i[None, :]
        k1, k2 = _rotate(tl.load(k_src, mask=km, other=0.0),
                         tl.load(k_src + half, mask=km, other=0.0), c, s,
                         qkv.dtype.element_ty)
        k_dst = k_cache + slot * stride_kcs + kh[:, None] * D + i[None, :]
        tl.store(k_dst, _to_cache(k1, k_scale, k_cache.dtype.element_ty, FP8), mask=km)
        tl.store(k_dst + half, _to_cache(k2, k_scale, k_cache.dtype.element_ty, FP8), mask=km)
        dd = tl.arange(0, D_PAD)
        vm = (kh < HKV)[:, None] & (dd < D)[None, :]
        x = tl.load(row + (H + HKV) * D + kh[:, None] * D + dd[None, :], mask=vm)
        tl.store(v_cache + slot * stride_vcs + kh[:, None] * D + dd[None, :],
                 _to_cache(x, v_scale, v_cache.dtype.element_ty, FP8), mask=vm)


@triton.jit
def indexer_scores_kernel(
    score, q_idx, weights, idx_cache, block_table, row_of, pos_of, width,
    stride_qt, stride_qh, stride_wt, stride_cb, stride_cs, stride_bt, stride_st,
    HI: tl.constexpr, HI_PAD: tl.constexpr, DI: tl.constexpr, DI_PAD: tl.constexpr,
    BLOCK_L: tl.constexpr, PAGE: tl.constexpr, IEEE: tl.constexpr,
):
    """The lightning indexer's scores of one token over BLOCK_L positions of its row:
    ``score[t, l] = sum_h weights[t, h] * relu(q_idx[t, h] . key(l))`` for l <= pos_of[t],
    the keys read from the paged index cache through block-table row ``row_of[t]``; -inf
    past the token's position (pos_of -1: a padded token) and up to `width`."""
    t = tl.program_id(0)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_h = tl.arange(0, HI_PAD)
    offs_d = tl.arange(0, DI_PAD)
    h_ok = offs_h < HI
    d_ok = offs_d < DI
    row = tl.load(row_of + t)
    vis = (offs_l < width) & (offs_l <= tl.load(pos_of + t))
    q = tl.load(q_idx + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(weights + t * stride_wt + offs_h, mask=h_ok, other=0.0)
    page = tl.load(block_table + row * stride_bt + offs_l // PAGE, mask=vis, other=0)
    k = tl.load(idx_cache + page[:, None] * stride_cb + (offs_l % PAGE)[:, None] * stride_cs
                + offs_d[None, :], mask=vis[:, None] & d_ok[None, :], other=0.0)
    if IEEE:  # float32 inputs: exact products (TF32 would reorder near-tied scores)
        logits = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        logits = tl.dot(q, tl.trans(k))
    s = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)
    tl.store(score + t * stride_st + offs_l, tl.where(vis, s, float("-inf")),
             mask=offs_l < width)


@triton.jit
def _gemv_acc(acc, xt, wt, M_PAD: tl.constexpr, IEEE: tl.constexpr):
    """acc + xt [M_PAD, BLOCK_K] . wt [BLOCK_N, BLOCK_K]^T, in float32. M_PAD 1: acc is
    [BLOCK_N, BLOCK_K] of products, summed over K once at the end (`_gemv_sum`), so no
    loop iteration waits on a cross-thread reduction; else acc is [M_PAD, BLOCK_N]."""
    if M_PAD == 1:
        acc += xt.to(tl.float32) * wt.to(tl.float32)
    elif IEEE:
        acc += tl.dot(xt, tl.trans(wt), input_precision="ieee")
    else:
        acc += tl.dot(xt, tl.trans(wt))
    return acc


@triton.jit
def _gemv_zeros(M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if M_PAD == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    else:
        acc = tl.zeros((M_PAD, BLOCK_N), tl.float32)
    return acc


@triton.jit
def _gemv_sum(acc, M_PAD: tl.constexpr):
    """`_gemv_acc`'s accumulator as [M_PAD, BLOCK_N]."""
    if M_PAD == 1:
        acc = tl.sum(acc, 1)[None, :]
    return acc


@triton.jit
def _gemv_rows(x, delta, gamma, rstd, kk, offs_m, m_ok, stride_xm, stride_dm, K: tl.constexpr,
               ADD: tl.constexpr, NORM: tl.constexpr):
    """The [M_PAD, BLOCK_K] input tile at columns `kk`: x (+ delta, rounded to x's dtype),
    then RMS-normalized by `rstd` [M_PAD] and scaled by gamma, in x's dtype. Returns
    (tile, the sum before the norm)."""
    k_ok = (kk < K)[None, :]
    ok = m_ok[:, None] & k_ok
    h = tl.load(x + offs_m[:, None] * stride_xm + kk[None, :], mask=ok, other=0.0)
    if ADD:
        h = (h.to(tl.float32) + tl.load(delta + offs_m[:, None] * stride_dm + kk[None, :],
                                        mask=ok, other=0.0).to(tl.float32)).to(h.dtype)
    xt = h
    if NORM:
        g = tl.load(gamma + kk, mask=kk < K, other=0.0).to(tl.float32)
        xt = (h.to(tl.float32) * rstd[:, None] * g[None, :]).to(h.dtype)
    return xt, h


@triton.jit
def _gemv_input(x, delta, gamma, rstd, h_out, kk, offs_m, m_ok, stride_xm, stride_dm,
                stride_hm, K: tl.constexpr, ADD: tl.constexpr, NORM: tl.constexpr):
    """The product's input tile at columns `kk` (`_gemv_rows`); with ADD, program 0 also
    writes the summed rows to h_out."""
    xt, h = _gemv_rows(x, delta, gamma, rstd, kk, offs_m, m_ok, stride_xm, stride_dm, K,
                       ADD, NORM)
    if ADD:
        tl.store(h_out + offs_m[:, None] * stride_hm + kk[None, :], h,
                 mask=m_ok[:, None] & (kk < K)[None, :] & (tl.program_id(0) == 0))
    return xt


@triton.jit(do_not_specialize=("M",))
def small_m_linear_kernel(
    x, w, y, delta, gamma, h_out, M, N, eps, stride_xm, stride_wn, stride_ym, stride_dm,
    stride_hm, K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, IEEE: tl.constexpr, ADD: tl.constexpr,
    NORM: tl.constexpr, GLU: tl.constexpr, STAGES: tl.constexpr,
):
    """y[:, n0:n0 + BLOCK_N] = x @ w[n0:n0 + BLOCK_N].T for x's M (<= M_PAD) rows, the
    weight rows streamed once in BLOCK_K tiles. M_PAD 1: a multiply-and-sum; else tl.dot
    with the rows padded to M_PAD (>= 16).

    ADD: the input is h = x + delta (rounded to x's dtype), which program 0 writes to
    h_out. NORM: the input is RMSNorm(h) = h / sqrt(mean(h^2) + eps) * gamma (float32
    inside, rounded to x's dtype; every program sums the squares of its rows itself). GLU:
    w holds 2 N rows, gate then up, and y = silu(x @ gate.T) * (x @ up.T).

    STAGES: weight tiles in flight (the loop's software pipeline, through shared memory);
    set on the loop itself, since Triton pipelines a loop whose loads feed no tl.dot (the
    one-row product) only when the loop asks for it."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, M_PAD)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = w + offs_n[:, None] * stride_wn
    k_ok = (offs_k < K)[None, :]
    wt = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
    if GLU:
        ut = tl.load(w_rows + N * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok,
                     other=0.0)
    if USE_PDL:  # weights never depend on the previous kernel: the first tile is in flight
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start its own prologue
    rstd = tl.zeros((M_PAD,), tl.float32)
    if NORM:
        for i in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            _, h = _gemv_rows(x, delta, gamma, rstd, i * BLOCK_K + offs_k, offs_m, m_ok,
                              stride_xm, stride_dm, K, ADD, False)
            hf = h.to(tl.float32)
            rstd += tl.sum(hf * hf, 1)
        rstd = 1.0 / tl.sqrt(rstd / K + eps)
    # the first tile apart: its weights were loaded before the PDL wait
    xt = _gemv_input(x, delta, gamma, rstd, h_out, offs_k, offs_m, m_ok, stride_xm,
                     stride_dm, stride_hm, K, ADD, NORM)
    acc = _gemv_acc(_gemv_zeros(M_PAD, BLOCK_N, BLOCK_K), xt, wt, M_PAD, IEEE)
    if GLU:
        acc_u = _gemv_acc(_gemv_zeros(M_PAD, BLOCK_N, BLOCK_K), xt, ut, M_PAD, IEEE)
    for i in tl.range(1, (K + BLOCK_K - 1) // BLOCK_K, num_stages=STAGES):
        kk = i * BLOCK_K + offs_k
        k_ok = (kk < K)[None, :]
        wt = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        if GLU:
            ut = tl.load(w_rows + N * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok,
                         other=0.0)
        xt = _gemv_input(x, delta, gamma, rstd, h_out, kk, offs_m, m_ok, stride_xm,
                         stride_dm, stride_hm, K, ADD, NORM)
        acc = _gemv_acc(acc, xt, wt, M_PAD, IEEE)
        if GLU:
            acc_u = _gemv_acc(acc_u, xt, ut, M_PAD, IEEE)
    acc = _gemv_sum(acc, M_PAD)
    if GLU:
        acc_u = _gemv_sum(acc_u, M_PAD)
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u
    tl.store(y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
