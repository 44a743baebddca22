"""DeepSeek sparse attention (DeepSeek-V3.2) of a transformers model on the sparse-indexer
backend.

The latent attention is `graphattn.models.hf_mla`'s; each layer also has a lightning
indexer. While graphattn's forward runs, the indexer's forward is this module's: it projects
the indexer's queries, keys and head weights with the layer's own modules (the key and query
rotated by the model's non-interleaved rotary over its rope dims), writes the keys to a paged
index cache and returns each token's top-k positions
(`graphattn.backends.sparse_indexer.SparseIndexerImpl.select`: scored over the paged keys on
the device, the spans' widths from the CPU plan). The model hands those to the attention
function as ``indices``, and the absorbed queries attend over the selected positions of the
latent cache only (`SparseIndexerImpl.attend`). Outside graphattn's forward the indexer runs
its own forward: the user's model is unchanged.
"""

from __future__ import annotations

import sys
from types import MethodType
from typing import Any

import torch
from torch import nn

from graphattn.backends.mla import write_latent
from graphattn.backends.reference import allocate_kv_cache
from graphattn.backends.sparse_indexer import SparseIndexerImpl, SparseIndexerMetadata
from graphattn.models.hf_mla import LatentAttention, MLALayout

__all__ = ["SparseLatentAttention", "indexer_refusal", "indexers"]

# what the indexer's forward is rebuilt from
_PARTS = ("wq_b", "wk", "k_norm", "weights_proj", "n_heads", "head_dim", "qk_rope_head_dim",
          "index_topk", "softmax_scale")


def indexers(model: nn.Module) -> dict[int, nn.Module]:
    """The lightning indexer of each latent-attention layer, by layer index (empty: none)."""
    return {m.layer_idx: m.indexer for m in model.modules()
            if hasattr(m, "kv_b_proj") and isinstance(getattr(m, "indexer", None), nn.Module)}


def indexer_refusal(model: nn.Module) -> str | None:
    """Why the model's indexers cannot run here, or None (no indexer, or the one this module
    rebuilds: the parts it reads and the rotary function of the model's module)."""
    for idx in indexers(model).values():
        missing = [p for p in _PARTS if not hasattr(idx, p)]
        if missing or _rotary(idx) is None:
            return (f"its indexer {type(idx).__name__} lacks "
                    f"{', '.join(missing) or 'apply_rotary_pos_emb'}, which the sparse-indexer "
                    f"path rebuilds its scores from")
    return None


def _rotary(indexer: nn.Module) -> Any:
    return getattr(sys.modules.get(type(indexer).__module__), "apply_rotary_pos_emb", None)


class SparseLatentAttention(LatentAttention):
    """The latent path of every layer of a DeepSeek-V3.2 model, with its indexer's top-k.

    Parameters
    ----------
    model : nn.Module
        A transformers model whose attention layers have an indexer (`indexers`).
    layout : MLALayout
    """

    def __init__(self, model: nn.Module, layout: MLALayout) -> None:
        super().__init__(model, layout)
        found = indexers(model)
        first = next(iter(found.values()))
        self.index_dim = first.head_dim
        self.topk = first.index_topk
        self._step: tuple[Any, SparseIndexerMetadata] | None = None
        self._mask_keys = tuple(sorted(set(getattr(model.config, "layer_types", None) or ())
                                       | {"full_attention", "indexed_attention"}))
        self._placeholder: torch.Tensor | None = None
        self._selector = SparseIndexerImpl(layout.num_heads, first.head_dim, 1, self.topk)
        # one function for every indexer, bound to each (no layer index in it: a regional
        # compile of the decoder layer then serves every layer)
        forward = self._dispatch()
        for idx in found.values():
            idx.forward = MethodType(forward, idx)

    def _dispatch(self) -> Any:
        def forward(indexer: nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor], *args: Any,
                    **kwargs: Any) -> torch.Tensor:
            if self._step is None:  # the user's own forward
                return type(indexer).forward(indexer, hidden_states, q_resid,
                                             position_embeddings, *args, **kwargs)
            return self._select(indexer, hidden_states, q_resid, position_embeddings)
        return forward

    def allocate(self, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (latent cache, index cache): [num_blocks + 1, block_size, 1,
        kv_lora_rank + rope] and [..., 1, index_head_dim]."""
        self._placeholder = torch.zeros(1, 1, 1, 1, dtype=dtype, device=device)
        latent = super().allocate(num_layers, num_blocks, block_size, dtype, device)
        return [(c, allocate_kv_cache(num_blocks, block_size, 1, self.index_dim, dtype, device))
                for c in latent]

    def begin(self, owner: Any, meta: Any) -> dict[str, Any]:
        """Record for one forward; the model gets a placeholder mask per layer type (its
        attention slices the mask it hands the indexer, which this forward never reads)."""
        super().begin(owner, meta)
        self._step = (owner, meta)
        return {"attention_mask": dict.fromkeys(self._mask_keys, self._placeholder)}

    def end(self) -> None:
        super().end()
        self._step = None

    def _impl(self, scaling: float) -> SparseIndexerImpl:
        """A new (stateless) impl per call (see `LatentAttention.attend`)."""
        lo = self.layout
        return SparseIndexerImpl(lo.num_heads, lo.kv_lora_rank + lo.qk_rope_head_dim, 1,
                                 self.topk, scale=scaling)

    def _select(self, indexer: nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """int64 [1, T, topk]: each token's top-k positions (-1 past its visible keys)."""
        owner, meta = self._step
        t, r = hidden_states.shape[1], indexer.qk_rope_head_dim
        q = indexer.wq_b(q_resid).view(1, t, indexer.n_heads, indexer.head_dim)
        k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)  # [1, T, 1, D]
        q_rot, k_rot = _rotary(indexer)(q[..., :r], k[..., :r], *rope, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., r:]], -1)[0]
        k = torch.cat([k_rot, k[..., r:]], -1)[0, :, 0]
        proj = indexer.weights_proj
        weights = proj(hidden_states.to(proj.weight.dtype)).float()[0] * (
            indexer.n_heads ** -0.5 * indexer.softmax_scale)  # relu(c x) = c relu(x), c > 0
        index_cache = owner.layer_cache(indexer)[0][1]
        return self._selector.select(q, k, weights, index_cache, meta)[None]

    def attend(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, scaling: float,
               cache: Any, meta: SparseIndexerMetadata,
               indices: torch.Tensor | None) -> torch.Tensor:
        """Absorbed queries over the latent cache at each token's selected positions."""
        if indices is None:
            raise ValueError("the sparse latent path needs the indexer's selection (the "
                             "model's attention passes it as `indices`)")
        latent = cache[0]
        write_latent(latent, meta.slot_mapping, kv_c, k_pe)
        return self._impl(scaling).attend(q, latent, latent[..., :self.layout.kv_lora_rank],
                                          indices[0], meta)
