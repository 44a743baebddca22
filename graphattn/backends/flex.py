"""flex_attention over a paged cache, block mask sized by the length bucket.

The gathered KV length is the *bucket* of the upper bound (never the live
length), so one compiled flex kernel serves every batch of a bucket; the
mask itself reads the true lengths on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from capture.buckets import LengthBuckets
from capture.dispatcher import GraphKey
from graphattn.backends.kernels import (
    block_count,
    gather_paged,
    token_positions,
    token_request_index,
    write_to_cache,
)
from graphattn.backends.paged import PagedTensors, check_key_fits, paged_tensors
from graphattn.metadata import CommonAttentionMetadata
from graphattn.sync import opaque_region

__all__ = ["FlexAttentionBuilder", "FlexAttentionImpl", "FlexAttentionMetadata"]


@dataclass(slots=True)
class FlexAttentionMetadata(PagedTensors):
    """Flex plan: max_len is a bucket; the KV axis is rows * num_kv_blocks * block_size.

    Tensors: see PagedTensors.
    """

    max_len: int
    num_kv_blocks: int


class FlexAttentionBuilder:
    """Parameters: block_size, and the LengthBuckets that size the block mask."""

    def __init__(self, block_size: int, length_buckets: LengthBuckets) -> None:
        if block_size < 1:
            raise ValueError(f"block_size = {block_size}, expected >= 1")
        self.block_size = block_size
        self.length_buckets = length_buckets

    def build(self, common: CommonAttentionMetadata,
              key: GraphKey | None = None) -> FlexAttentionMetadata:
        if key is not None:
            check_key_fits(common, key)
            max_len = key.max_len_bucket
        else:
            max_len = self.length_buckets.bucket(common.max_seq_len)
        return FlexAttentionMetadata(
            max_len=max_len,
            num_kv_blocks=block_count(max_len, self.block_size,
                                      common.block_table_tensor.shape[1]),
            **paged_tensors(common))


class FlexAttentionImpl:
    """Paged attention through flex_attention (compiled on CUDA by default).

    Parameters
    ----------
    num_heads, head_dim, num_kv_heads : int
    compile : bool, optional
        torch.compile flex_attention (default: on CUDA only; off elsewhere, where
        the unfused reference implementation runs).
    mask_block_size : int
        BLOCK_SIZE of the block mask (a multiple of 128 when compiled on CUDA);
        queries and the gathered KV axis are padded to multiples of it.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                 scale: float | None = None, compile: bool | None = None,
                 mask_block_size: int = 128) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.compile = compile
        self.mask_block_size = mask_block_size
        self._compiled = None

    def _flex(self, device: torch.device):
        use = self.compile if self.compile is not None else device.type == "cuda"
        if not use:
            return flex_attention
        if device.type == "cuda" and self.mask_block_size % 128:
            raise ValueError(
                f"mask_block_size = {self.mask_block_size}: compiled flex_attention on CUDA "
                "needs a multiple of 128 (its Triton kernel has no smaller tile)"
            )
        if self._compiled is None:
            self._compiled = torch.compile(flex_attention, dynamic=False)
        return self._compiled

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: FlexAttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D] (padded tokens give 0)."""
        k_cache, v_cache = kv_cache
        write_to_cache(k_cache, meta.slot_mapping, k)
        write_to_cache(v_cache, meta.slot_mapping, v)
        t = q.shape[0]
        rows = meta.block_table.shape[0]
        if t == 0 or rows == 0:
            return q.new_zeros(t, q.shape[1], v.shape[-1])
        kv_per_row = meta.num_kv_blocks * k_cache.shape[1]
        # Both axes padded to the mask block: the compiled kernel needs multiples of it.
        blk = self.mask_block_size
        tq = -(-t // blk) * blk
        kv_len = -(-(rows * kv_per_row) // blk) * blk

        def gathered(cache: torch.Tensor) -> torch.Tensor:
            x = rearrange(gather_paged(cache, meta.block_table, meta.num_kv_blocks),
                          "r l h d -> 1 h (r l) d")
            return nn.functional.pad(x, (0, 0, 0, kv_len - x.shape[2])).to(q.dtype)

        req = token_request_index(meta.query_start_loc, t)
        pos = token_positions(meta.query_start_loc, meta.seq_lens, req)
        valid = meta.slot_mapping[:t] >= 0
        req = nn.functional.pad(req, (0, tq - t), value=-1)
        pos = nn.functional.pad(pos, (0, tq - t))
        valid = nn.functional.pad(valid, (0, tq - t))

        def mask_mod(b, h, q_idx, kv_idx):
            row = kv_idx // kv_per_row
            return (row == req[q_idx]) & (kv_idx - row * kv_per_row <= pos[q_idx]) & valid[q_idx]

        block_mask = create_block_mask(mask_mod, None, None, tq, kv_len, device=q.device,
                                       BLOCK_SIZE=blk)
        qp = nn.functional.pad(rearrange(q, "t h d -> 1 h t d"), (0, 0, 0, tq - t))
        with opaque_region():
            out = self._flex(q.device)(
                qp, gathered(k_cache), gathered(v_cache), block_mask=block_mask,
                scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        out = out[:, :, :t]
        return rearrange(out, "1 h t d -> t h d")
