"""flex_attention over a paged cache, block mask sized by the length bucket.

The gathered KV length is the *bucket* of the upper bound (never the live
length), so one compiled flex kernel serves every batch of a bucket; the
mask itself reads the true lengths on the device.

Two layouts, chosen from CPU numbers (`FlexAttentionBuilder.row_query_len`). Per-row (a
uniform key's batches; in eager mode any batch whose rows x max query length is at most
twice its tokens): rows on flex's batch axis, each with up to q queries gathered from its
tokens and its own gathered KV, so a query block never spans rows and flex's decoding
kernel serves q < 128. Packed (mixed keys): every token on one query axis over all rows' KV
concatenated, a query block skipping the KV blocks of rows it does not hold; there a block
of 128 queries that spans many one-token rows visits all of their KV.

The builder computes the BlockMask's block tensors itself with a few
fixed-shape device ops (`block_mask_tensors`), the same tensors
create_block_mask gives for this mask but capturable: create_block_mask
copies pageable host memory, which CUDA graph capture refuses. The impl
rebuilds the BlockMask from them with ``BlockMask.from_kv_blocks`` (no device
work) and calls flex_attention compiled through `graphattn.compile.BucketCompiler`
(one compile per shape, loud instead of silently eager past dynamo's
recompile limit, whose eager fallback cannot be captured either).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import ClassVar

import torch
from einops import rearrange
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from graphattn.backends.paged import PagedTensors, check_key_fits, paged_tensors
from graphattn.backends.reference import (
    block_count,
    gather_paged,
    token_positions,
    token_request_index,
    write_to_cache,
)
from graphattn.buckets import LengthBuckets
from graphattn.compile import BucketCompiler
from graphattn.keys import GraphKey
from graphattn.metadata import CommonAttentionMetadata
from graphattn.sync import opaque_region

__all__ = ["FlexAttentionBuilder", "FlexAttentionImpl", "FlexAttentionMetadata",
           "block_mask_tensors", "row_block_mask_tensors"]


@dataclass(slots=True)
class FlexAttentionMetadata(PagedTensors):
    """Flex plan and tensors.

    Attributes
    ----------
    max_len, num_kv_blocks, cache_block_size : int
        Bucketed length; cache blocks gathered per row, and their size.
    mask_block_size, q_len, kv_len : int
        Block-mask tile, and the query / KV axes (per row in the per-row layout; padded to
        multiples of the tile, except a per-row query axis).
    row_query_len : int
        q of the per-row layout (rows on flex's batch axis, q query slots each); 0: packed.
    row_tokens : torch.Tensor
        int64 [rows, q]: the token in each query slot (clamped; see mask_valid). Packed: [0].
    token_cells : torch.Tensor
        int64 [T]: each token's query slot, row * q + offset (clamped). Packed: [0].
    mask_req, mask_pos : torch.Tensor
        int64 [q_len] (per-row layout: [rows, q_len]): row and position of each query
        (-1 / 0 when padded).
    mask_valid : torch.Tensor
        bool, shaped as mask_pos: query slots holding a real token.
    kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices : torch.Tensor
        The BlockMask's block tensors (see torch.nn.attention.flex_attention), batch axis
        1 (packed) or rows.
    Other tensors: see PagedTensors.
    """

    tensor_fields: ClassVar[tuple[str, ...]] = PagedTensors.tensor_fields + (
        "mask_req", "mask_pos", "mask_valid", "row_tokens", "token_cells", "kv_num_blocks",
        "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    max_len: int
    num_kv_blocks: int
    cache_block_size: int
    mask_block_size: int
    q_len: int
    kv_len: int
    row_query_len: int
    mask_req: torch.Tensor
    mask_pos: torch.Tensor
    mask_valid: torch.Tensor
    row_tokens: torch.Tensor
    token_cells: torch.Tensor
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor


def _mask_mod(req: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, kv_per_row: int):
    def mask_mod(b, h, q_idx, kv_idx):
        row = kv_idx // kv_per_row
        return (row == req[q_idx]) & (kv_idx - row * kv_per_row <= pos[q_idx]) & valid[q_idx]

    return mask_mod


def _row_mask_mod(pos: torch.Tensor, valid: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= pos[b, q_idx]) & valid[b, q_idx]

    return mask_mod


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block counts [B, 1, nq] and indices [B, 1, nq, nk] (present blocks first, ascending)
    of a [B, nq, nk] block presence."""
    dense = dense.to(torch.int32)
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None], idx[:, None]


def _block_tensors(lo: torch.Tensor, hi: torch.Tensor, ok: torch.Tensor, exists: torch.Tensor,
                   kv_len: int, block: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tensors of queries that see keys lo..hi when ok, shaped [B, Q] (Q a multiple of
    `block`); `exists`: query slots flex runs (the others neither touch nor break a full
    block)."""
    b, q = lo.shape
    first = torch.arange(0, kv_len, block, device=lo.device)
    last = first + block - 1
    lo, hi, ok, exists = lo[..., None], hi[..., None], ok[..., None], exists[..., None]
    touch = (ok & (lo <= last) & (hi >= first)).view(b, q // block, block, -1).any(2)
    full = (~exists | (ok & (lo <= first) & (hi >= last))).view(b, q // block, block, -1).all(2)
    return (*_ordered(touch & ~full), *_ordered(full & touch))


def block_mask_tensors(req: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                       kv_per_row: int, kv_len: int,
                       block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tensors of the packed flex mask, from fixed-shape device ops (capturable).

    Query q sees key positions ``req[q] * kv_per_row .. req[q] * kv_per_row +
    pos[q]`` when ``valid[q]``: the mask of `_mask_mod`. The result equals
    create_block_mask's for that mask_mod with ``BLOCK_SIZE=block``.

    Parameters
    ----------
    req, pos : torch.Tensor
        int64 [q_len]: row and position of each query (q_len a multiple of block).
    valid : torch.Tensor
        bool [q_len].
    kv_per_row, kv_len, block : int
        Gathered positions per row, the KV axis (a multiple of block), the tile.

    Returns
    -------
    kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices : torch.Tensor
        int32 [1, 1, q_len / block] and [1, 1, q_len / block, kv_len / block]:
        partial blocks (the mask_mod decides) and full blocks (all visible).
    """
    q_len = req.shape[0]
    if q_len % block or kv_len % block:
        raise ValueError(f"q_len {q_len} and kv_len {kv_len} must be multiples of {block}")
    lo = req * kv_per_row
    hi = lo + pos.clamp(max=kv_per_row - 1)
    return _block_tensors(lo[None], hi[None], valid[None], torch.ones_like(valid[None]), kv_len,
                          block)


def row_block_mask_tensors(pos: torch.Tensor, valid: torch.Tensor, kv_len: int,
                           block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor]:
    """Block tensors of the per-row flex mask (capturable): batch element b's query j sees
    keys 0..pos[b, j] of its own row when valid[b, j] (`_row_mask_mod`). Equal to
    create_block_mask's for that mask_mod with ``BLOCK_SIZE=block`` when q is a multiple of
    block; otherwise the same blocks, more of them full: create_block_mask pads the query
    axis with masked slots, which break full blocks, while flex never runs those slots.

    Parameters
    ----------
    pos : torch.Tensor
        int64 [rows, q]: position of each query in its row (clamped to kv_len - 1).
    valid : torch.Tensor
        bool [rows, q].
    kv_len, block : int
        Gathered positions per row (a multiple of block), the tile.

    Returns
    -------
    kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices : torch.Tensor
        int32 [rows, 1, ceil(q / block)] and [rows, 1, ceil(q / block), kv_len / block].
    """
    if kv_len % block:
        raise ValueError(f"kv_len {kv_len} must be a multiple of {block}")
    rows, q = pos.shape
    pad = -(-q // block) * block - q
    hi = nn.functional.pad(pos.clamp(max=kv_len - 1), (0, pad))
    ok = nn.functional.pad(valid, (0, pad))
    exists = nn.functional.pad(torch.ones_like(valid), (0, pad))
    return _block_tensors(torch.zeros_like(hi), hi, ok, exists, kv_len, block)


_FROM_KV_KWARGS = (
    {"compute_q_blocks": False}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters else {}
)


class FlexAttentionBuilder:
    """Plans flex metadata from CPU numbers and builds its block mask (capturable device ops).

    Parameters
    ----------
    block_size : int
        KV-cache block size.
    length_buckets : LengthBuckets
        Size the gathered KV axis in eager mode (a key's bucket in graph mode).
    mask_block_size : int
        BLOCK_SIZE of the block mask (a multiple of 128 when compiled on CUDA);
        the KV axis (and the packed layout's query axis) is padded to multiples of it.
    layout : str
        "auto": per-row for a uniform key's batches and, in eager mode, for batches whose
        rows x max query length is at most twice their tokens (`row_query_len`), packed
        otherwise; "packed": always packed (the reference the per-row layout is
        benchmarked against).
    """

    LAYOUTS: ClassVar[tuple[str, ...]] = ("auto", "packed")

    def __init__(self, block_size: int, length_buckets: LengthBuckets,
                 mask_block_size: int = 128, layout: str = "auto") -> None:
        if block_size < 1 or mask_block_size < 1:
            raise ValueError(
                f"block_size = {block_size}, mask_block_size = {mask_block_size}: both must be >= 1"
            )
        if layout not in self.LAYOUTS:
            raise ValueError(f"layout = {layout!r}, expected one of {self.LAYOUTS}")
        self.block_size = block_size
        self.length_buckets = length_buckets
        self.mask_block_size = mask_block_size
        self.layout = layout

    def row_query_len(self, common: CommonAttentionMetadata, key: GraphKey | None) -> int:
        """Query slots per row of the per-row layout for this batch (CPU numbers only; every
        row's query count is at most that); 0: packed."""
        if self.layout == "packed" or common.num_reqs == 0:
            return 0
        if key is not None:
            return key.query_len if key.uniform_decode else 0
        q = common.max_query_len
        return q if 0 < common.num_reqs * q <= 2 * common.num_tokens_padded else 0

    def build(self, common: CommonAttentionMetadata,
              key: GraphKey | None = None) -> FlexAttentionMetadata:
        if key is not None:
            check_key_fits(common, key)
            max_len = key.max_len_bucket
        else:
            max_len = self.length_buckets.bucket(common.max_seq_len)
        nb = block_count(max_len, self.block_size, common.block_table_tensor.shape[1])
        t, rows, blk = common.num_tokens_padded, common.num_reqs, self.mask_block_size
        kv_per_row = nb * self.block_size
        device = common.slot_mapping.device
        req = token_request_index(common.query_start_loc, t) if rows else torch.zeros(
            t, dtype=torch.long, device=device)
        valid = common.slot_mapping[:t] >= 0
        q = self.row_query_len(common, key)
        if q:
            q_len, kv_len = q, -(-kv_per_row // blk) * blk
            qsl = common.query_start_loc.long()
            start, count = qsl[:-1, None], (qsl[1:] - qsl[:-1])[:, None]
            j = torch.arange(q, device=device)
            row_tokens = (start + j).clamp(max=max(t - 1, 0))
            valid = (j < count) & valid[row_tokens]
            pos = common.seq_lens.long()[:, None] - count + j
            token_cells = req * q + (torch.arange(t, device=device) - qsl[req]).clamp(0, q - 1)
            req = torch.arange(rows, device=device)[:, None].expand(rows, q)
            tensors = row_block_mask_tensors(pos, valid, kv_len, blk)
        else:
            pos = token_positions(common.query_start_loc, common.seq_lens, req) if rows else req
            q_len = max(-(-t // blk) * blk, blk)
            kv_len = max(-(-(rows * kv_per_row) // blk) * blk, blk)
            req = nn.functional.pad(req, (0, q_len - t), value=-1)
            pos = nn.functional.pad(pos, (0, q_len - t))
            valid = nn.functional.pad(valid, (0, q_len - t))
            row_tokens = token_cells = torch.zeros(0, dtype=torch.long, device=device)
            tensors = block_mask_tensors(req, pos, valid, kv_per_row, kv_len, blk)
        kv_num, kv_idx, full_num, full_idx = tensors
        return FlexAttentionMetadata(
            max_len=max_len, num_kv_blocks=nb, mask_block_size=blk, q_len=q_len, kv_len=kv_len,
            row_query_len=q, mask_req=req, mask_pos=pos, mask_valid=valid,
            row_tokens=row_tokens, token_cells=token_cells, kv_num_blocks=kv_num,
            kv_indices=kv_idx, full_kv_num_blocks=full_num, full_kv_indices=full_idx,
            cache_block_size=self.block_size, **paged_tensors(common))


class FlexAttentionImpl:
    """Paged attention through flex_attention (compiled on CUDA by default).

    Parameters
    ----------
    num_heads, head_dim, num_kv_heads : int
    compile : bool, optional
        torch.compile flex_attention (default: on CUDA only; off elsewhere, where
        the unfused reference implementation runs). Uncompiled flex cannot be
        captured in a CUDA graph: its unfused path copies a pageable host scalar.
    max_compiles : int
        Shapes compiled at most (about one per graph key); more raise.

    Attributes
    ----------
    compiler : BucketCompiler or None
        The compiled flex_attention, once first used (its `num_compiles`).
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                 scale: float | None = None, compile: bool | None = None,
                 max_compiles: int = 256) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.compile = compile
        self.max_compiles = max_compiles
        self.compiler: BucketCompiler | None = None

    def _flex(self, device: torch.device, mask_block_size: int):
        use = self.compile if self.compile is not None else device.type == "cuda"
        if not use:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ValueError(
                    "uncompiled flex_attention cannot be captured in a CUDA graph (its unfused "
                    "path copies a pageable host scalar); use compile=True"
                )
            return flex_attention
        if device.type == "cuda" and mask_block_size % 128:
            raise ValueError(
                f"mask_block_size = {mask_block_size}: compiled flex_attention on CUDA "
                "needs a multiple of 128 (its Triton kernel has no smaller tile)"
            )
        if self.compiler is None:
            self.compiler = BucketCompiler(flex_attention, max_compiles=self.max_compiles)
        return self.compiler

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: FlexAttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D] (padded tokens give 0)."""
        k_cache, v_cache = kv_cache
        write_to_cache(k_cache, meta.slot_mapping, k)
        write_to_cache(v_cache, meta.slot_mapping, v)
        t = q.shape[0]
        if t == 0 or meta.block_table.shape[0] == 0:
            return q.new_zeros(t, q.shape[1], v.shape[-1])
        if k_cache.shape[1] != meta.cache_block_size:
            raise ValueError(f"cache block size {k_cache.shape[1]}, but the builder planned for "
                             f"{meta.cache_block_size}")
        kv_per_row = meta.num_kv_blocks * meta.cache_block_size
        q_rows = meta.row_query_len
        if q_rows:  # rows on the batch axis: [rows, H, q, D] over [rows, Hkv, kv_len, D]
            mask_mod = _row_mask_mod(meta.mask_pos, meta.mask_valid)
            pattern, kv_pad = "r l h d -> r h l d", meta.kv_len - kv_per_row
            qp = rearrange(q[meta.row_tokens], "r q h d -> r h q d")
        else:  # every token on one query axis over all rows' KV
            mask_mod = _mask_mod(meta.mask_req, meta.mask_pos, meta.mask_valid, kv_per_row)
            pattern = "r l h d -> 1 h (r l) d"
            kv_pad = meta.kv_len - meta.block_table.shape[0] * kv_per_row
            qp = nn.functional.pad(rearrange(q, "t h d -> 1 h t d"), (0, 0, 0, meta.q_len - t))

        def gathered(cache: torch.Tensor) -> torch.Tensor:
            x = rearrange(gather_paged(cache, meta.block_table, meta.num_kv_blocks), pattern)
            return nn.functional.pad(x, (0, 0, 0, kv_pad)).to(q.dtype)

        block_mask = BlockMask.from_kv_blocks(
            meta.kv_num_blocks, meta.kv_indices, meta.full_kv_num_blocks, meta.full_kv_indices,
            BLOCK_SIZE=meta.mask_block_size, mask_mod=mask_mod,
            seq_lengths=(meta.q_len, meta.kv_len), **_FROM_KV_KWARGS)
        with opaque_region():
            out = self._flex(q.device, meta.mask_block_size)(
                qp, gathered(k_cache), gathered(v_cache), block_mask=block_mask,
                scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        if q_rows:  # masked slots gave 0; tokens of no row (padding) read a masked slot
            out = rearrange(out, "r h q d -> (r q) h d")[meta.token_cells]
            return torch.where((meta.slot_mapping[:t] >= 0)[:, None, None], out, 0)
        return rearrange(out[:, :, :t], "1 h t d -> t h d")
