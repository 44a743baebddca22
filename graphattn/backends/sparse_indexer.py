"""Top-k sparse attention with a lightning indexer (the DeepSeek V3.2 pattern).

Each query token scores every visible key with a small indexer
(``sum_h w[h] * relu(q_idx[h] . k_idx)``), keeps the top-k positions, and
attends to those only. The indexer logits of a prefill are [tokens, keys]:
prefill rows are grouped into chunks whose ``tokens * max key length`` fits a
budget, planned on CPU from the upper bound. On CUDA the scores come from
`indexer_scores_kernel` (keys read from the paged index cache, nothing gathered)
and the attention over the selection from the unified Triton kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from graphattn.backends import launch_config
from graphattn.backends.launch_config import KERNELS
from graphattn.backends.ops import kv_bounds
from graphattn.backends.paged import (
    PagedAttentionBuilder,
    PagedAttentionMetadata,
    PagedTensors,
    paged_tensors,
)
from graphattn.backends.reference import (
    block_count,
    cache_slots,
    gather_paged,
    token_positions,
    token_request_index,
    write_to_cache,
)
from graphattn.backends.registry import PadValue
from graphattn.backends.triton_launch import indexer_scores
from graphattn.keys import GraphKey
from graphattn.metadata import CommonAttentionMetadata

__all__ = ["PrefillChunk", "SparseIndexerBuilder", "SparseIndexerImpl", "SparseIndexerMetadata",
           "plan_prefill_chunks"]


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Rows [req_start, req_end) and tokens [tok_start, tok_end) scored together.

    max_len is the largest bound among the rows: the logits width.
    """

    req_start: int
    req_end: int
    tok_start: int
    tok_end: int
    max_len: int


def plan_prefill_chunks(query_lens: np.ndarray, bounds: np.ndarray, budget: int,
                        row_offset: int = 0, tok_offset: int = 0) -> tuple[PrefillChunk, ...]:
    """Greedy chunks of consecutive rows with tokens * max(bound) <= budget.

    Vectorized within a chunk (cumsum / cummax / searchsorted); loops over
    chunks only. A single row over the budget forms a chunk by itself.
    """
    n = int(query_lens.shape[0])
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    chunks = []
    i = 0
    while i < n:
        toks = np.cumsum(query_lens[i:])
        cost = toks * np.maximum.accumulate(bounds[i:])
        j = i + max(int(np.searchsorted(cost, budget, side="right")), 1)
        chunks.append(PrefillChunk(row_offset + i, row_offset + j, tok_offset + int(starts[i]),
                                   tok_offset + int(starts[j]), int(bounds[i:j].max())))
        i = j
    return tuple(chunks)


@dataclass(slots=True)
class SparseIndexerMetadata(PagedAttentionMetadata):
    """Sparse-indexer plan and tensors; decode plan and tensors as PagedAttentionMetadata
    (max_len: bound max of the decode rows, or the key's bucket).

    Attributes
    ----------
    prefill_chunks : tuple[PrefillChunk, ...]
    token_rows, token_pos : torch.Tensor
        int64 [T]: each token's row and sequence position (T = len(slot_mapping)), built
        once per step for every layer's selection and attention (graph inputs beside the
        paged tensors where the build runs outside the capture).
    """

    tensor_fields: ClassVar[tuple[str, ...]] = (*PagedTensors.tensor_fields, "token_rows",
                                                "token_pos")
    pad_values: ClassVar[dict[str, PadValue]] = {**PagedTensors.pad_values,
                                                 "token_rows": "edge", "token_pos": -1}
    prefill_chunks: tuple[PrefillChunk, ...]
    token_rows: torch.Tensor
    token_pos: torch.Tensor


class SparseIndexerBuilder(PagedAttentionBuilder):
    """Plans sparse-indexer metadata.

    Parameters
    ----------
    block_size : int
    logits_budget : int
        Max tokens * keys scored at once in a prefill chunk.
    decode_query_len : int
    """

    def __init__(self, block_size: int, logits_budget: int, decode_query_len: int = 1) -> None:
        if min(block_size, logits_budget, decode_query_len) < 1:
            raise ValueError(
                f"block_size={block_size}, logits_budget={logits_budget}, "
                f"decode_query_len={decode_query_len}: all must be >= 1"
            )
        super().__init__(block_size, decode_query_len)
        self.logits_budget = logits_budget

    def build(self, common: CommonAttentionMetadata,
              key: GraphKey | None = None) -> SparseIndexerMetadata:
        q = common.query_lens_cpu
        bound = common.seq_lens_cpu_upper_bound.numpy()
        plan = self.plan(common, key, uniform_only=True)
        nd, qd = plan.num_decodes, plan.decode_query_len
        if key is None:  # the decode rows alone decide the decode path's key length
            max_len = int(bound[:nd].max(initial=0))
            plan = dataclasses.replace(plan, max_len=max_len, num_kv_blocks=block_count(
                max_len, self.block_size, common.block_table_tensor.shape[1]))
        n_pre = int((q[nd:] > 0).sum())
        pre = slice(nd, nd + n_pre)
        chunks = plan_prefill_chunks(q[pre], bound[pre], self.logits_budget, nd, nd * qd)
        rows = token_request_index(common.query_start_loc, common.slot_mapping.shape[0])
        return SparseIndexerMetadata(
            **{**plan.as_kwargs(), "shared_prefix": 0}, shared_rows=None, prefill_chunks=chunks,
            token_rows=rows, token_pos=token_positions(common.query_start_loc, common.seq_lens,
                                                       rows),
            **paged_tensors(common))


class SparseIndexerImpl:
    """Indexer top-k selection, then attention over the selected positions.

    The attention over the selection is ``torch.ops.graphattn.paged_attention`` with each
    token as a one-query row whose "pages" are its selected cache slots (a page of one
    position: the cache viewed as [slots, 1, Hkv, D]), so the Triton kernel reads the
    selected K/V straight from the cache on CUDA and the plain-torch kernel is the
    reference elsewhere.

    Parameters
    ----------
    num_heads, head_dim, num_kv_heads : int
    topk : int
        Positions kept per query token.
    kernel : str
        Attention kernel over the selection (`graphattn.backends.launch_config.KERNELS`).
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, topk: int,
                 scale: float | None = None, kernel: str = "auto") -> None:
        if topk < 1:
            raise ValueError(f"topk = {topk}, expected >= 1")
        if kernel not in KERNELS:
            raise ValueError(f"kernel = {kernel!r}, expected one of {KERNELS}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.topk = topk
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.kernel = kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: torch.Tensor,
                k_idx: torch.Tensor, weights: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                meta: SparseIndexerMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse attention output and the selected positions.

        Parameters
        ----------
        q : [T, H, D]; k, v : [T, Hkv, D]
        q_idx : [T, Hi, Di]; k_idx : [T, Di]; weights : [T, Hi]
            Indexer queries, keys and per-head weights.
        kv_cache : (k_cache, v_cache, idx_cache); idx_cache [blocks + 1, block_size, 1, Di].

        Returns
        -------
        out : torch.Tensor
            [T, H, D]; padded tokens give 0.
        topk_pos : torch.Tensor
            int64 [T, topk], selected positions by descending score; -1 where
            fewer than topk keys are visible.
        """
        k_cache, v_cache, i_cache = kv_cache
        write_to_cache(k_cache, meta.slot_mapping, k)
        write_to_cache(v_cache, meta.slot_mapping, v)
        sel = self.select(q_idx, k_idx, weights, i_cache, meta)
        return self.attend(q, k_cache, v_cache, sel, meta), sel

    def select(self, q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor,
               idx_cache: torch.Tensor, meta: SparseIndexerMetadata) -> torch.Tensor:
        """Write the indexer keys, then each token's top-k visible positions.

        A token at position p scores keys [0, p] by ``sum_h weights[h] * relu(q_idx[h] . k)``
        and keeps the `topk` best (all of them when p < topk). The decode rows are scored
        together up to the key's block bound, each prefill chunk up to its own bound.

        Parameters
        ----------
        q_idx : [T, Hi, Di]; k_idx : [T, Di]; weights : [T, Hi]
        idx_cache : [blocks + 1, block_size, 1, Di]

        Returns
        -------
        torch.Tensor
            int64 [T, topk], positions by descending score; -1 past the token's visible
            keys and for padded tokens.
        """
        write_to_cache(idx_cache, meta.slot_mapping, k_idx.unsqueeze(1))
        sel = torch.full((q_idx.shape[0], self.topk), -1, dtype=torch.long,
                         device=q_idx.device)
        spans = []
        if meta.num_decodes:
            spans.append((0, meta.num_decodes, 0, meta.num_decode_tokens, meta.num_kv_blocks))
        for c in meta.prefill_chunks:
            nb = block_count(c.max_len, idx_cache.shape[1], meta.block_table.shape[1])
            spans.append((c.req_start, c.req_end, c.tok_start, c.tok_end, nb))
        for r0, r1, t0, t1, nb in spans:
            chosen = self._select_span(q_idx[t0:t1], weights[t0:t1], idx_cache, meta, r0, r1,
                                       t0, nb)
            sel[t0:t1, :chosen.shape[1]] = chosen
        return sel

    def _select_span(self, q_idx: torch.Tensor, weights: torch.Tensor, idx_cache: torch.Tensor,
                     meta: SparseIndexerMetadata, r0: int, r1: int, t0: int,
                     nb: int) -> torch.Tensor:
        """int64 [Tc, min(topk, nb * block_size)]: the top positions of tokens [t0, t0 + Tc)
        of rows [r0, r1) over their first `nb` blocks (-1 past the visible keys)."""
        tc = q_idx.shape[0]
        req = meta.token_rows[t0 : t0 + tc] - r0
        pos = meta.token_pos[t0 : t0 + tc]
        valid = meta.slot_mapping[t0 : t0 + tc] >= 0
        bt, width = meta.block_table[r0:r1], nb * idx_cache.shape[1]
        if launch_config.resolve_kernel(self.kernel, q_idx.device) == "triton":
            score = indexer_scores(q_idx, weights.float(), idx_cache, bt, req,
                                   torch.where(valid, pos, -1), width)
        else:
            keys = gather_paged(idx_cache, bt, nb)[req, :, 0]  # [Tc, L, Di]
            cdt = torch.float64 if q_idx.dtype == torch.float64 else torch.float32
            logits = torch.einsum("thd,tld->thl", q_idx.to(cdt), keys.to(cdt)).relu()
            score = torch.einsum("thl,th->tl", logits, weights.to(cdt))
            lpos = torch.arange(width, device=q_idx.device)
            score = score.masked_fill(~((lpos <= pos[:, None]) & valid[:, None]), float("-inf"))
        kk = min(self.topk, width)
        top = score.topk(kk, dim=-1).indices
        count = torch.where(valid, torch.clamp(pos + 1, max=kk), 0)
        return torch.where(torch.arange(kk, device=q_idx.device) < count[:, None], top, -1)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               sel: torch.Tensor, meta: SparseIndexerMetadata) -> torch.Tensor:
        """Attention of each token over its selected positions only.

        One ``torch.ops.graphattn.paged_attention`` call: every token a one-query row whose
        pages are its selected cache slots (the caches viewed as pages of one slot).

        Parameters
        ----------
        q : [T, H, D]
        k_cache, v_cache : [blocks + 1, block_size, Hkv, D] and [..., Dv] (views allowed:
            the latent cache's value part)
        sel : int64 [T, topk] from `select`

        Returns
        -------
        torch.Tensor
            [T, H, Dv]; padded tokens give 0.
        """
        t, topk = sel.shape
        req = meta.token_rows[:t]
        count = (sel >= 0).sum(-1).to(torch.int32)
        slots = cache_slots(meta.block_table[req], sel.clamp(min=0), k_cache.shape[1])
        return torch.ops.graphattn.paged_attention(
            q, k_cache.flatten(0, 1).unsqueeze(1), v_cache.flatten(0, 1).unsqueeze(1),
            torch.arange(t + 1, dtype=torch.int32, device=q.device), count,
            slots.to(torch.int32), meta.slot_mapping[:t], self.scale, t, 1,
            kv_bounds(topk, topk), 0, 0.0, None, self.kernel)
