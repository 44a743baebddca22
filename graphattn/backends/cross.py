"""Encoder-decoder cross attention over a paged cache of encoder K/V."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from graphattn.backends.ops import kv_bounds
from graphattn.backends.paged import check_key_fits
from graphattn.backends.reference import block_count, token_request_index, write_to_cache
from graphattn.backends.registry import BackendMetadata, PadValue
from graphattn.checks import as_int32_array
from graphattn.keys import GraphKey
from graphattn.metadata import CommonAttentionMetadata
from graphattn.transfer import to_device

__all__ = ["CrossAttentionBuilder", "CrossAttentionImpl", "CrossAttentionMetadata",
           "cached_cross_metadata"]


@dataclass(slots=True)
class CrossAttentionMetadata(BackendMetadata):
    """Cross-attention plan and tensors.

    Attributes
    ----------
    num_computed_tokens_cpu : np.ndarray
        int32 [rows], bound - query lens (exact where it decides anything: a
        row's first step has no drafts).
    num_cache_decodes : int
        Rows whose encoder K/V is already cached (computed tokens > 0).
    num_encoder_tokens : int
        Encoder tokens written this step (rows in their first step).
    max_encoder_len : int
        Encoder positions gathered per row.
    encoder_seq_lens : int32 [rows]; cross_block_table : int32 [rows, blocks];
    cross_slot_mapping : int64 [num_encoder_tokens]; query_start_loc : int32 [rows + 1].
    """

    tensor_fields: ClassVar[tuple[str, ...]] = (
        "query_start_loc", "encoder_seq_lens", "cross_block_table", "cross_slot_mapping")
    pad_values: ClassVar[dict[str, PadValue]] = {"cross_slot_mapping": -1,
                                                 "query_start_loc": "edge"}
    num_computed_tokens_cpu: np.ndarray
    num_cache_decodes: int
    num_encoder_tokens: int
    max_encoder_len: int
    num_kv_blocks: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    encoder_seq_lens: torch.Tensor
    cross_block_table: torch.Tensor
    cross_slot_mapping: torch.Tensor


def cached_cross_metadata(query_start_loc: torch.Tensor, encoder_seq_lens: torch.Tensor,
                          cross_block_table: torch.Tensor, max_encoder_len: int,
                          block_size: int) -> CrossAttentionMetadata:
    """Metadata of rows whose encoder K/V is already cached (capturable: no host work).

    For a model that writes each request's encoder K/V once, when it is admitted: every
    row reads its own blocks, nothing is written in the step. The CPU numbers are fixed by
    the encoder length cap, so one captured graph serves any mix of requests
    (`num_actual_tokens` is 0: not known on the host, and the impl does not read it).

    Parameters
    ----------
    query_start_loc : int32 [rows + 1] (device)
    encoder_seq_lens : int32 [rows] (device): each row's encoder length (0: padded row)
    cross_block_table : int32 [rows, blocks] (device): each row's encoder cache blocks
    max_encoder_len, block_size : int
    """
    rows = cross_block_table.shape[0]
    return CrossAttentionMetadata(
        num_computed_tokens_cpu=np.zeros(rows, np.int32), num_cache_decodes=rows,
        num_encoder_tokens=0, max_encoder_len=max_encoder_len,
        num_kv_blocks=block_count(max_encoder_len, block_size, cross_block_table.shape[1]),
        num_actual_tokens=0, query_start_loc=query_start_loc,
        encoder_seq_lens=encoder_seq_lens, cross_block_table=cross_block_table,
        cross_slot_mapping=query_start_loc.new_zeros(0, dtype=torch.int64))


class CrossAttentionBuilder:
    """Plans cross attention from CPU numbers.

    Parameters
    ----------
    block_size : int
    max_encoder_len : int
        Encoder positions gathered inside a captured graph (a key fixes no
        encoder length, so graphs use this cap).
    """

    def __init__(self, block_size: int, max_encoder_len: int) -> None:
        if block_size < 1 or max_encoder_len < 1:
            raise ValueError(
                f"block_size = {block_size}, max_encoder_len = {max_encoder_len}: both must be >= 1"
            )
        self.block_size = block_size
        self.max_encoder_len = max_encoder_len

    def build(self, common: CommonAttentionMetadata, encoder_seq_lens_np: np.ndarray,
              cross_block_table_np: np.ndarray, cross_block_table: torch.Tensor,
              key: GraphKey | None = None) -> CrossAttentionMetadata:
        """Metadata of one batch.

        Parameters
        ----------
        encoder_seq_lens_np : np.ndarray
            int32 [rows] encoder length per row (0 in padded rows).
        cross_block_table_np, cross_block_table : np.ndarray, torch.Tensor
            int32 [rows, blocks]: the encoder cache blocks per row, CPU and device.
        """
        rows = common.num_reqs
        enc = as_int32_array("encoder_seq_lens_np", encoder_seq_lens_np, 0, self.max_encoder_len)
        cbt = np.asarray(cross_block_table_np)
        if enc.shape != (rows,) or cbt.ndim != 2 or cbt.shape[0] != rows:
            raise ValueError(
                f"encoder_seq_lens_np {enc.shape} / cross_block_table_np {cbt.shape}: expected "
                f"({rows},) and ({rows}, blocks)"
            )
        need = -(-int(enc.max(initial=0)) // self.block_size)
        if cbt.shape[1] < need or cross_block_table.shape != cbt.shape:
            raise ValueError(
                f"cross_block_table_np has {cbt.shape[1]} columns (device copy "
                f"{tuple(cross_block_table.shape)}), expected >= {need} for encoder length "
                f"{int(enc.max(initial=0))} and the same shape on both"
            )
        qlens = common.query_lens_cpu
        computed = common.num_computed_tokens_cpu_upper_bound
        first = (computed == 0) & (qlens > 0)
        new_enc = np.where(first, enc, 0)
        total = int(new_enc.sum())
        if key is not None:
            check_key_fits(common, key)
            if total:
                raise ValueError(
                    f"a graph key cannot write encoder tokens; {int(first.sum())} rows are in "
                    "their first step (run them eager)"
                )
            max_enc = self.max_encoder_len
        else:
            max_enc = int(enc.max(initial=1))
        row = np.repeat(np.arange(rows), new_enc)
        e = np.arange(total) - np.repeat(np.cumsum(new_enc) - new_enc, new_enc)
        bs = self.block_size
        slots = cross_block_table_np[row, e // bs].astype(np.int64) * bs + e % bs
        device = common.query_start_loc.device
        return CrossAttentionMetadata(
            num_computed_tokens_cpu=computed,
            num_cache_decodes=int((computed > 0).sum()),
            num_encoder_tokens=total,
            max_encoder_len=max_enc,
            num_kv_blocks=block_count(max_enc, bs, cross_block_table.shape[1]),
            num_actual_tokens=common.num_actual_tokens,
            query_start_loc=common.query_start_loc,
            encoder_seq_lens=to_device(enc, device),
            cross_block_table=cross_block_table,
            cross_slot_mapping=to_device(slots, device),
        )


class CrossAttentionImpl:
    """Decoder queries over their request's encoder K/V (no causal mask).

    Each query token runs as its own row of ``torch.ops.graphattn.paged_attention`` (one
    query over all of its request's encoder positions, which is what the causal kernel
    computes for a last token), so CUDA gets the Triton kernel and CPU the plain-torch
    reference, with no host reads.

    Parameters
    ----------
    num_heads, head_dim : int
    num_kv_heads : int, optional
    scale : float, optional
        Default head_dim ** -0.5.
    kernel : {"auto", "triton", "varlen", "torch"}
        See `graphattn.backends.launch_config`.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                 scale: float | None = None, kernel: str = "auto") -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.kernel = kernel

    def forward(self, q: torch.Tensor, encoder_k: torch.Tensor | None,
                encoder_v: torch.Tensor | None, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: CrossAttentionMetadata) -> torch.Tensor:
        """Cross-attention output.

        Parameters
        ----------
        q : torch.Tensor
            [T, H, D] decoder queries.
        encoder_k, encoder_v : torch.Tensor or None
            [num_encoder_tokens, Hkv, D] for the rows in their first step,
            concatenated in row order; None when there are none.
        kv_cache : (k_cache, v_cache) of the encoder side.

        Returns
        -------
        torch.Tensor
            [T, H, D]; tokens past the real ones give 0.
        """
        k_cache, v_cache = kv_cache
        if meta.num_encoder_tokens:
            if encoder_k is None or encoder_k.shape[0] != meta.num_encoder_tokens:
                got = None if encoder_k is None else encoder_k.shape[0]
                raise ValueError(f"encoder_k has {got} tokens, expected {meta.num_encoder_tokens}")
            write_to_cache(k_cache, meta.cross_slot_mapping, encoder_k)
            write_to_cache(v_cache, meta.cross_slot_mapping, encoder_v)
        t = q.shape[0]
        req = token_request_index(meta.query_start_loc, t)
        real = torch.arange(t, device=q.device) < meta.query_start_loc[-1]
        lens = torch.where(real, meta.encoder_seq_lens[req], 0).to(torch.int32)
        rows = torch.arange(t + 1, device=q.device, dtype=torch.int32)
        return torch.ops.graphattn.paged_attention(
            q, k_cache, v_cache, rows, lens, meta.cross_block_table[req],
            torch.full((t,), -1, dtype=torch.int64, device=q.device), self.scale, t, 1,
            kv_bounds(meta.num_kv_blocks, meta.max_encoder_len), 0, 0.0, None, self.kernel)
