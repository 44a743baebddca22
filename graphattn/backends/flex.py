"""flex_attention over a paged cache, block mask sized by the length bucket.

The gathered KV length is the *bucket* of the upper bound (never the live
length), so one compiled flex kernel serves every batch of a bucket; the
mask itself reads the true lengths on the device.

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

from graphattn.backends.kernels import (
    block_count,
    gather_paged,
    token_positions,
    token_request_index,
    write_to_cache,
)
from graphattn.backends.paged import PagedTensors, check_key_fits, paged_tensors
from graphattn.buckets import LengthBuckets
from graphattn.compile import BucketCompiler
from graphattn.keys import GraphKey
from graphattn.metadata import CommonAttentionMetadata
from graphattn.sync import opaque_region

__all__ = ["FlexAttentionBuilder", "FlexAttentionImpl", "FlexAttentionMetadata",
           "block_mask_tensors"]


@dataclass(slots=True)
class FlexAttentionMetadata(PagedTensors):
    """Flex plan and tensors.

    Attributes
    ----------
    max_len, num_kv_blocks, cache_block_size : int
        Bucketed length; cache blocks gathered per row, and their size.
    mask_block_size, q_len, kv_len : int
        Block-mask tile, and the query / KV axes padded to multiples of it.
    mask_req, mask_pos : torch.Tensor
        int64 [q_len]: row and position of each query (-1 / 0 when padded).
    mask_valid : torch.Tensor
        bool [q_len]: real query tokens.
    kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices : torch.Tensor
        The BlockMask's block tensors (see torch.nn.attention.flex_attention).
    Other tensors: see PagedTensors.
    """

    tensor_fields: ClassVar[tuple[str, ...]] = PagedTensors.tensor_fields + (
        "mask_req", "mask_pos", "mask_valid", "kv_num_blocks", "kv_indices",
        "full_kv_num_blocks", "full_kv_indices")
    max_len: int
    num_kv_blocks: int
    cache_block_size: int
    mask_block_size: int
    q_len: int
    kv_len: int
    mask_req: torch.Tensor
    mask_pos: torch.Tensor
    mask_valid: torch.Tensor
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor


def _mask_mod(req: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, kv_per_row: int):
    def mask_mod(b, h, q_idx, kv_idx):
        row = kv_idx // kv_per_row
        return (row == req[q_idx]) & (kv_idx - row * kv_per_row <= pos[q_idx]) & valid[q_idx]

    return mask_mod


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block counts [1, 1, nq] and indices [1, 1, nq, nk] (present blocks first, ascending)."""
    dense = dense.to(torch.int32)
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None], idx[None, None]


def block_mask_tensors(req: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                       kv_per_row: int, kv_len: int,
                       block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tensors of the paged flex mask, from fixed-shape device ops (capturable).

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
    first = torch.arange(0, kv_len, block, device=req.device)
    last = first + block - 1
    lo, hi, ok = lo[:, None], hi[:, None], valid[:, None]
    touch = (ok & (lo <= last) & (hi >= first)).view(q_len // block, block, -1).any(1)
    full = (ok & (lo <= first) & (hi >= last)).view(q_len // block, block, -1).all(1)
    return (*_ordered(touch & ~full), *_ordered(full))


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
        queries and the gathered KV axis are padded to multiples of it.
    """

    def __init__(self, block_size: int, length_buckets: LengthBuckets,
                 mask_block_size: int = 128) -> None:
        if block_size < 1 or mask_block_size < 1:
            raise ValueError(
                f"block_size = {block_size}, mask_block_size = {mask_block_size}: both must be >= 1"
            )
        self.block_size = block_size
        self.length_buckets = length_buckets
        self.mask_block_size = mask_block_size

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
        q_len = max(-(-t // blk) * blk, blk)
        kv_len = max(-(-(rows * kv_per_row) // blk) * blk, blk)
        req = token_request_index(common.query_start_loc, t) if rows else torch.zeros(
            t, dtype=torch.long, device=common.slot_mapping.device)
        pos = token_positions(common.query_start_loc, common.seq_lens, req) if rows else req
        valid = common.slot_mapping[:t] >= 0
        req = nn.functional.pad(req, (0, q_len - t), value=-1)
        pos = nn.functional.pad(pos, (0, q_len - t))
        valid = nn.functional.pad(valid, (0, q_len - t))
        kv_num, kv_idx, full_num, full_idx = block_mask_tensors(req, pos, valid, kv_per_row,
                                                                kv_len, blk)
        return FlexAttentionMetadata(
            max_len=max_len, num_kv_blocks=nb, mask_block_size=blk, q_len=q_len, kv_len=kv_len,
            mask_req=req, mask_pos=pos, mask_valid=valid, kv_num_blocks=kv_num,
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

        def gathered(cache: torch.Tensor) -> torch.Tensor:
            x = rearrange(gather_paged(cache, meta.block_table, meta.num_kv_blocks),
                          "r l h d -> 1 h (r l) d")
            return nn.functional.pad(x, (0, 0, 0, meta.kv_len - x.shape[2])).to(q.dtype)

        kv_per_row = meta.num_kv_blocks * meta.cache_block_size
        block_mask = BlockMask.from_kv_blocks(
            meta.kv_num_blocks, meta.kv_indices, meta.full_kv_num_blocks, meta.full_kv_indices,
            BLOCK_SIZE=meta.mask_block_size,
            mask_mod=_mask_mod(meta.mask_req, meta.mask_pos, meta.mask_valid, kv_per_row),
            seq_lengths=(meta.q_len, meta.kv_len), **_FROM_KV_KWARGS)
        qp = nn.functional.pad(rearrange(q, "t h d -> 1 h t d"), (0, 0, 0, meta.q_len - t))
        with opaque_region():
            out = self._flex(q.device, meta.mask_block_size)(
                qp, gathered(k_cache), gathered(v_cache), block_mask=block_mask,
                scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return rearrange(out[:, :, :t], "1 h t d -> t h d")
