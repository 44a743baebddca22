"""Run a transformers decoder (Llama and alike) on graphattn's paged backend.

The model's own modules run unchanged; attention goes through a function
registered in transformers' AttentionInterface, which reads graphattn
metadata and a paged KV cache instead of HF's cache and mask. The causal
mask builder of the model is bypassed (it inspects position data on the
host), so the whole step stays sync-free and capturable.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from graphattn.backends.kernels import allocate_kv_cache
from graphattn.backends.paged import PagedAttentionImpl, PagedAttentionMetadata

__all__ = ["HFCausalLM", "ATTN_NAME"]

ATTN_NAME = "graphattn_paged"


def _graphattn_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                         dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    ctx: HFCausalLM = kwargs["graphattn_runner"]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = ctx.impl_for(module, scaling).forward(q, k, v, ctx.caches[module.layer_idx],
                                               kwargs["graphattn_metadata"])
    return out.unsqueeze(0), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _graphattn_attention)


class HFCausalLM:
    """`graphattn.capture.runner.ModelForward` around a transformers causal LM.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        E.g. LlamaForCausalLM; needs ``model.model.{embed_tokens, rotary_emb,
        layers, norm}`` and ``model.lm_head`` (the Llama family layout).
    """

    def __init__(self, model: nn.Module) -> None:
        _register()
        self.model = model.eval()
        cfg = model.config
        cfg._attn_implementation = ATTN_NAME
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._impls: dict[float, PagedAttentionImpl] = {}

    def impl_for(self, module: nn.Module, scaling: float | None) -> PagedAttentionImpl:
        s = float(scaling if scaling is not None else self.head_dim ** -0.5)
        if s not in self._impls:
            self._impls[s] = PagedAttentionImpl(self.num_heads, self.head_dim, self.num_kv_heads,
                                                scale=s)
        return self._impls[s]

    def allocate_caches(self, num_blocks: int, block_size: int) -> None:
        p = next(self.model.parameters())
        self.caches = [tuple(allocate_kv_cache(num_blocks, block_size, self.num_kv_heads,
                                               self.head_dim, p.dtype, p.device)
                             for _ in range(2)) for _ in range(self.num_layers)]

    def __call__(self, inputs: dict[str, torch.Tensor],
                 attn_metadata: PagedAttentionMetadata) -> torch.Tensor:
        if not self.caches:
            raise ValueError("call allocate_caches(num_blocks, block_size) first")
        inner = self.model.model
        pos = inputs["positions"][None]
        h = inner.embed_tokens(inputs["input_ids"][None])
        pe = inner.rotary_emb(h, position_ids=pos)
        for layer in inner.layers[: self.num_layers]:
            out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe,
                        graphattn_runner=self, graphattn_metadata=attn_metadata)
            h = out[0] if isinstance(out, tuple) else out
        return self.model.lm_head(inner.norm(h))[0]
