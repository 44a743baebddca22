"""EagleHead: an EAGLE-style draft head (one decoder layer on paged KV) for DraftModelProposer.

At position j the head reads the token t_j and the target's hidden state at j - 1
(EAGLE: features one step behind the tokens), mixes them with one linear layer, runs one
decoder layer over its own paged KV cache, and predicts t_{j+1} through the target's own
final norm and LM head. Chained draft passes feed the head's own output feature
(`last_hidden_states`) as the next pass's hidden state.

The target exposes its hidden states through ``keep_hidden_states`` (TinyDecoder: the last
layer's output before the final norm; HFCausalLM: transformers' ``hidden_states[-1]``);
`DraftModelProposer` sets it and feeds them to the head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from graphattn.backends.paged import PagedAttentionImpl, PagedAttentionMetadata
from graphattn.backends.reference import allocate_kv_cache
from graphattn.backends.rope import cos_sin, inv_frequencies
from graphattn.models.tiny import TinyConfig, TinyDecoder, _Layer

__all__ = ["EagleHead"]


class EagleHead(nn.Module):
    """EAGLE-style draft head.

    ``forward(inputs, attn_metadata)`` reads "input_ids" (int64 [T]), "positions" (int64
    [T]), "hidden_states" ([T, hidden], the target's state one position back) and
    "logits_indices" (int64 [R]); returns logits [R, vocab].

    Parameters
    ----------
    cfg : TinyConfig
        The layer's shape (hidden size, heads, KV heads, MLP, rope theta); its
        vocab_size must be the target's.
    embed : nn.Embedding
        The target's token embedding (shared, not copied).
    norm, lm_head : nn.Module
        The target's final norm and LM head (shared).
    impl : object, optional
        Attention impl; default PagedAttentionImpl.
    """

    static_input_names = ("input_ids", "positions", "hidden_states", "logits_indices")

    def __init__(self, cfg: TinyConfig, embed: nn.Module, norm: nn.Module, lm_head: nn.Module,
                 impl: Any = None) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = _Layer(cfg)
        self.embed, self.norm, self.lm_head = embed, norm, lm_head
        self.impl = impl or PagedAttentionImpl(cfg.local_heads, cfg.head_dim, cfg.local_kv_heads)
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.inv_freq: torch.Tensor | None = None
        self.last_hidden_states: torch.Tensor | None = None

    @classmethod
    def for_target(cls, target: Any) -> EagleHead:
        """A random head sharing the target's embedding and LM head: a TinyDecoder's (and
        its final norm), or a wrapped transformers model's (`HFCausalLM`: its input and
        output embeddings; the head has a norm of its own, since transformers' last hidden
        state is normed already and the head's output is not)."""
        if isinstance(target, TinyDecoder):
            cfg, embed, norm, head = target.cfg, target.embed, target.norm, target.lm_head
            p = next(target.parameters())
        else:
            model = target.model
            c = model.config
            cfg = TinyConfig(c.vocab_size, c.hidden_size, 1, c.num_attention_heads,
                             getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                             c.intermediate_size, float(getattr(c, "rope_theta", 10000.0)))
            embed, head = model.get_input_embeddings(), model.get_output_embeddings()
            norm = nn.RMSNorm(c.hidden_size)
            p = next(model.parameters())
        return cls(cfg, embed, norm, head).to(p.device, p.dtype)

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    def allocate_caches(self, num_blocks: int, block_size: int) -> None:
        p, c = self.fc.weight, self.cfg
        self.inv_freq = inv_frequencies(c.head_dim, c.rope_theta, p.device)
        self.caches = [tuple(allocate_kv_cache(num_blocks, block_size, c.local_kv_heads,
                                               c.head_dim, p.dtype, p.device)
                             for _ in range(2))]

    def forward(self, inputs: dict[str, torch.Tensor],
                attn_metadata: PagedAttentionMetadata) -> torch.Tensor:
        if not self.caches:
            raise ValueError("call allocate_caches(num_blocks, block_size) first")
        pos = inputs["positions"]
        x = self.fc(torch.cat([self.embed(inputs["input_ids"]),
                               inputs["hidden_states"].to(self.fc.weight.dtype)], -1))
        rot = None if hasattr(self.impl, "forward_qkv") else cos_sin(pos, self.inv_freq)
        x = self.layer(x, pos, self.inv_freq, rot, attn_metadata, self.impl, self.caches[0])
        self.last_hidden_states = x
        if "logits_indices" in inputs:
            x = x[inputs["logits_indices"]]
        return self.lm_head(self.norm(x))
