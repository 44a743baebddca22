"""MLA-style latent attention: one latent KV head, chunked-context prefill.

The cache holds ``[kv_c | k_pe]`` per token (kv_lora_rank + rope_dim wide);
queries arrive absorbed (``q_nope @ W_UK`` concatenated with ``q_pe``), values
are the latent part, outputs are ``[T, H, kv_lora_rank]``. Prefill rows attend
to their context in chunks that fit a fixed workspace, planned from the CPU
bound, and merge the partial results by log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphattn.backends.ops import kv_bounds
from graphattn.backends.paged import (
    PagedAttentionBuilder,
    PagedAttentionMetadata,
    paged_tensors,
)
from graphattn.backends.reference import (
    gather_positions,
    grouped_attention,
    merge_attention,
    token_request_index,
    write_to_cache,
)
from graphattn.keys import GraphKey
from graphattn.metadata import CommonAttentionMetadata

__all__ = ["MLABuilder", "MLAImpl", "MLAMetadata", "write_latent"]


def write_latent(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_c: torch.Tensor,
                 k_pe: torch.Tensor) -> None:
    """Store ``[kv_c | k_pe]`` of each token at its slot (padded tokens, slot -1, skipped).

    Parameters
    ----------
    kv_cache : [num_blocks + 1, block_size, 1, kv_lora_rank + rope_dim]
    slot_mapping : int64 [T]
    kv_c : [T, kv_lora_rank]; k_pe : [T, rope_dim]
    """
    write_to_cache(kv_cache, slot_mapping, torch.cat([kv_c, k_pe], -1).unsqueeze(1))


@dataclass(slots=True)
class MLAMetadata(PagedAttentionMetadata):
    """MLA plan and tensors; the decode plan and tensors are PagedAttentionMetadata's.

    Attributes
    ----------
    num_prefills, num_prefill_tokens : int
        Rows after the decode rows that have query tokens, and those tokens.
    context_lens_cpu : np.ndarray
        int32 [num_prefills], bound - query lens: context per prefill row.
    chunk_size, num_chunks : int
        Context positions per row per chunk (num_prefills * chunk_size <=
        workspace_size), and chunks to cover the largest context bound.
    max_prefill_query_len : int
    """

    num_prefills: int
    num_prefill_tokens: int
    context_lens_cpu: np.ndarray
    chunk_size: int
    num_chunks: int
    max_prefill_query_len: int


class MLABuilder(PagedAttentionBuilder):
    """Plans MLA metadata from CPU numbers.

    Parameters
    ----------
    block_size : int
    workspace_size : int
        Context tokens gathered at once across all prefill rows.
    decode_query_len : int
    """

    def __init__(self, block_size: int, workspace_size: int, decode_query_len: int = 1) -> None:
        if min(block_size, workspace_size, decode_query_len) < 1:
            raise ValueError(
                f"block_size={block_size}, workspace_size={workspace_size}, "
                f"decode_query_len={decode_query_len}: all must be >= 1"
            )
        super().__init__(block_size, decode_query_len)
        self.workspace_size = workspace_size

    def build(self, common: CommonAttentionMetadata, key: GraphKey | None = None) -> MLAMetadata:
        q = common.query_lens_cpu
        plan = self.plan(common, key, uniform_only=True)
        nd = plan.num_decodes
        num_prefills = int((q[nd:] > 0).sum())
        pre = slice(nd, nd + num_prefills)
        ctx = common.num_computed_tokens_cpu_upper_bound[pre]
        bs = self.block_size
        chunk = (self.workspace_size // max(num_prefills, 1)) // bs * bs
        if num_prefills and chunk < bs:
            raise ValueError(
                f"workspace_size {self.workspace_size} cannot hold one block of {bs} tokens for "
                f"each of {num_prefills} prefill rows"
            )
        chunk = max(chunk, bs)
        max_ctx = int(ctx.max(initial=0))
        return MLAMetadata(  # no shared-prefix pass: the latent decode reads every row whole
            **{**plan.as_kwargs(), "shared_prefix": 0}, shared_rows=None,
            num_prefills=num_prefills, num_prefill_tokens=int(q[pre].sum()),
            context_lens_cpu=ctx, chunk_size=chunk,
            num_chunks=-(-max_ctx // chunk), max_prefill_query_len=int(q[pre].max(initial=0)),
            **paged_tensors(common),
        )


class MLAImpl:
    """Absorbed MLA over the latent cache.

    Parameters
    ----------
    num_heads, kv_lora_rank, rope_dim : int
    scale : float
    kernel : str
        Kernel of the decode rows (`graphattn.backends.launch_config`; the latent cache is
        one KV head whose first kv_lora_rank dims are the values).
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float,
                 kernel: str = "auto") -> None:
        self.kernel = kernel
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                kv_cache: torch.Tensor, meta: MLAMetadata) -> torch.Tensor:
        """Latent attention output.

        Parameters
        ----------
        q : [T, H, kv_lora_rank + rope_dim] absorbed queries.
        kv_c : [T, kv_lora_rank]; k_pe : [T, rope_dim].
        kv_cache : [num_blocks + 1, block_size, 1, kv_lora_rank + rope_dim].

        Returns
        -------
        torch.Tensor
            [T, H, kv_lora_rank]; padded tokens give 0.
        """
        lora = self.kv_lora_rank
        write_latent(kv_cache, meta.slot_mapping, kv_c, k_pe)
        values = kv_cache[..., :lora]
        t, h = q.shape[0], q.shape[1]
        ndt = meta.num_decode_tokens
        outs = []
        if meta.num_decodes:
            nd = meta.num_decodes
            outs.append(torch.ops.graphattn.paged_attention(
                q[:ndt], kv_cache, values, meta.query_start_loc[: nd + 1], meta.seq_lens[:nd],
                meta.block_table[:nd], meta.slot_mapping[:ndt], self.scale, nd,
                meta.decode_query_len, kv_bounds(meta.num_kv_blocks, meta.max_len), 0, 0.0,
                None, self.kernel))
        n_pre = 0
        if meta.num_prefills:
            o = self._prefill(q, kv_cache, meta)
            n_pre = o.shape[0]
            outs.append(o)
        rest = t - ndt - n_pre
        if rest > 0:
            outs.append(q.new_zeros(rest, h, lora))
        return torch.cat(outs) if outs else q.new_zeros(0, h, lora)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: MLAMetadata) -> torch.Tensor:
        lora, dev = self.kv_lora_rank, q.device
        nd, p, qmax = meta.num_decodes, meta.num_prefills, meta.max_prefill_query_len
        qsl = meta.query_start_loc[nd : nd + p + 1]
        qlens = (qsl[1:] - qsl[:-1]).long()
        j = torch.arange(qmax, device=dev)
        valid = j < qlens[:, None]
        tok = (qsl[:-1, None] + j).clamp_(max=q.shape[0] - 1).long()
        qp = q[tok]  # [P, Qmax, H, Dq]
        bt = meta.block_table[nd : nd + p]
        ctx = meta.seq_lens[nd : nd + p].long() - qlens  # true context
        self_keys = gather_positions(kv_cache, bt, ctx[:, None] + j)
        hi = torch.where(valid, j + 1, 0)
        out, lse = grouped_attention(qp, self_keys, self_keys[..., :lora], hi, scale=self.scale)
        c = meta.chunk_size
        cj = torch.arange(c, device=dev)
        for i in range(meta.num_chunks):
            keys = gather_positions(kv_cache, bt, i * c + cj.expand(p, c))
            lim = (ctx - i * c).clamp(0, c)[:, None].expand(p, qmax)
            lim = torch.where(valid, lim, 0)
            oc, lc = grouped_attention(qp, keys, keys[..., :lora], lim, scale=self.scale)
            out, lse = merge_attention(out, lse, oc, lc)
        rows = token_request_index(qsl - qsl[0], meta.num_prefill_tokens)
        cols = torch.arange(rows.shape[0], device=dev) - (qsl[rows] - qsl[0])
        return out[rows, cols]
