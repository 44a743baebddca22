"""Multi-head latent attention (DeepSeek-V2 / V3) of a transformers model on the MLA backend.

The model's own forward runs: its projections, norms, rotary embedding (YaRN included) and
MoE. Each attention layer's normalised latent ``kv_c`` is taken from its ``kv_a_layernorm``
(a forward hook that records only while graphattn's forward runs); the rotated ``k_pe`` and
``q_pe`` from the key and query the layer hands to the attention function. The latent
``[kv_c | k_pe]`` is written to a paged cache of one head, queries are absorbed
(``q_nope @ W_UK``), `graphattn.backends.mla.MLAImpl` attends over the latent cache (the
decode rows through the paged kernel, prefills in context chunks) and ``W_UV`` expands the
result. The layer still expands its keys and values for the attention call, which the
latent path does not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphattn.backends.mla import MLAImpl, MLAMetadata
from graphattn.backends.reference import allocate_kv_cache

__all__ = ["LatentAttention", "MLALayout", "mla_layout"]


@dataclass(frozen=True, slots=True)
class MLALayout:
    """A latent-attention model's dimensions (from its config)."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


def mla_layout(model: nn.Module) -> MLALayout | None:
    """The model's latent-attention dimensions, or None when its attention is not latent."""
    cfg = model.config
    if getattr(cfg, "kv_lora_rank", None) is None or not any(
            hasattr(m, "kv_a_layernorm") and hasattr(m, "kv_b_proj") for m in model.modules()):
        return None
    return MLALayout(cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                     cfg.qk_rope_head_dim, cfg.v_head_dim)


class LatentAttention:
    """The latent path of every MLA layer of a model.

    Parameters
    ----------
    model : nn.Module
        A transformers DeepSeek-V2 / V3 model.
    layout : MLALayout
    """

    def __init__(self, model: nn.Module, layout: MLALayout) -> None:
        self.layout = layout
        self.recording = False
        # the latent of the layer running now: each layer's norm runs before its attention,
        # and one slot (no layer index) leaves a regional compile nothing per layer to guard
        self._latent: torch.Tensor | None = None
        for module in model.modules():
            if hasattr(module, "kv_a_layernorm") and hasattr(module, "kv_b_proj"):
                module.kv_a_layernorm.register_forward_hook(self._record)

    def _record(self, norm: nn.Module, args: Any, out: torch.Tensor) -> None:
        if self.recording:  # the user's own forward records nothing
            self._latent = out.reshape(-1, out.shape[-1])

    def allocate(self, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> list[torch.Tensor]:
        """One latent cache per layer: [num_blocks + 1, block_size, 1, kv_lora_rank + rope]."""
        lo = self.layout
        return [allocate_kv_cache(num_blocks, block_size, 1, lo.kv_lora_rank + lo.qk_rope_head_dim,
                                  dtype, device) for _ in range(num_layers)]

    def __call__(self, module: nn.Module, query: torch.Tensor, k_pe: torch.Tensor,
                 scaling: float, cache: Any, meta: MLAMetadata,
                 indices: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of one layer: `query` [H, T, nope + rope] and `k_pe` [T, rope] (both
        rotated); `indices`: what the layer's indexer returned, if it has one (see
        `graphattn.models.hf_dsa`). Returns [T, H, v_head_dim]."""
        lo = self.layout
        nope, lora = lo.qk_nope_head_dim, lo.kv_lora_rank
        w = module.kv_b_proj.weight.view(lo.num_heads, nope + lo.v_head_dim, lora)
        q = query.transpose(0, 1)  # [T, H, nope + rope]
        q_lat = torch.einsum("thn,hnl->thl", q[..., :nope], w[:, :nope])
        kv_c, self._latent = self._latent, None
        if kv_c is None:
            raise RuntimeError(f"{type(module).__name__}.kv_a_layernorm did not run before its "
                               "attention: the latent path records the latent there")
        kv_c = kv_c.to(q.dtype)
        out = self.attend(torch.cat([q_lat, q[..., nope:]], -1), kv_c, k_pe, float(scaling),
                          cache, meta, indices)
        return torch.einsum("thl,hvl->thv", out, w[:, nope:])

    def attend(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, scaling: float,
               cache: Any, meta: MLAMetadata, indices: torch.Tensor | None) -> torch.Tensor:
        """Absorbed queries [T, H, kv_lora_rank + rope] over the latent cache (writing this
        step's ``[kv_c | k_pe]`` first); [T, H, kv_lora_rank]."""
        # a new (stateless) impl per call: a cache of them would be a side effect that a
        # compiled step's next call guards on and recompiles for
        lo = self.layout
        impl = MLAImpl(lo.num_heads, lo.kv_lora_rank, lo.qk_rope_head_dim, scaling)
        return impl.forward(q, kv_c, k_pe, cache, meta)

    def begin(self, owner: Any, meta: Any) -> dict[str, Any]:
        """Start recording for one forward of `owner` (the wrapper whose ``layer_cache(module)``
        gives a layer's caches); returns the extra keyword arguments the model's forward
        takes."""
        self.recording = True
        return {}

    def end(self) -> None:
        self.recording = False
        self._latent = None
