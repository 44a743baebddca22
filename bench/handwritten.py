"""The peer a user writes by hand in ~50 lines: the same TinyDecoder weights, a static
contiguous KV cache per layer, ``F.scaled_dot_product_attention(enable_gqa=True)`` with a
length mask, one decode step (sampling, token and position advance included) captured whole
with ``torch.cuda.graph``, optionally compiled first with inductor.

It serves uniform decode of a fixed batch only (no paging, no mixed batches, no buckets):
the baseline our general runner has to match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphattn.backends.rope import rope
from graphattn.models.tiny import TinyDecoder

__all__ = ["HandwrittenDecode"]


class HandwrittenDecode:
    """Uniform decode of `batch` rows over a static cache of `max_len` positions.

    Parameters
    ----------
    model : TinyDecoder
        Weights are shared, not copied.
    batch, max_len : int
    compile_mode : str, optional
        torch.compile mode of the step before capture (None: eager step).
    """

    def __init__(self, model: TinyDecoder, batch: int, max_len: int,
                 compile_mode: str | None = None) -> None:
        c, p = model.cfg, next(model.parameters())
        self.model, self.max_len = model, max_len
        shape = (batch, c.num_kv_heads, max_len, c.head_dim)
        self.caches = [(torch.zeros(shape, dtype=p.dtype, device=p.device),
                        torch.zeros(shape, dtype=p.dtype, device=p.device))
                       for _ in range(c.num_layers)]
        self.ids = torch.zeros(batch, dtype=torch.int64, device=p.device)
        self.pos = torch.zeros(batch, dtype=torch.int64, device=p.device)
        self.rows = torch.arange(batch, device=p.device)
        self.span = torch.arange(max_len, device=p.device)
        self.fn = torch.compile(self._step, mode=compile_mode) if compile_mode else self._step
        self.graph: torch.cuda.CUDAGraph | None = None

    def _step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        m, c = self.model, self.model.cfg
        d, b = c.head_dim, ids.shape[0]
        x = m.embed(ids)
        mask = (self.span[None] <= pos[:, None])[:, None, None]  # [B, 1, 1, L]
        for layer, (kc, vc) in zip(m.layers, self.caches, strict=True):
            q, k, v = layer.qkv(layer.norm1(x)).split(
                [c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], -1)
            q = rope(q.view(b, c.num_heads, d), pos, c.rope_theta)
            k = rope(k.view(b, c.num_kv_heads, d), pos, c.rope_theta)
            kc[self.rows, :, pos] = k
            vc[self.rows, :, pos] = v.view(b, c.num_kv_heads, d)
            a = F.scaled_dot_product_attention(q[:, :, None], kc, vc, attn_mask=mask,
                                               enable_gqa=True)
            x = x + layer.o(a.reshape(b, -1))
            g, u = layer.up(layer.norm2(x)).chunk(2, -1)
            x = x + layer.down(F.silu(g) * u)
        return m.lm_head(m.norm(x)).argmax(-1)

    @torch.inference_mode()
    def capture(self, lengths: torch.Tensor) -> None:
        """Warm up (compiles) and capture one step; rows start at `lengths` positions."""
        self.reset(lengths)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.fn(self.ids, self.pos)
        torch.cuda.current_stream().wait_stream(side)
        try:
            self.graph = torch.cuda.CUDAGraph(keep_graph=True)  # node counts
        except TypeError:
            self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            tokens = self.fn(self.ids, self.pos)
            self.ids.copy_(tokens)
            self.pos.add_(1)
        if hasattr(self.graph, "instantiate"):
            self.graph.instantiate()
        self.reset(lengths)

    def reset(self, lengths: torch.Tensor) -> None:
        self.pos.copy_(lengths)

    def replay(self) -> None:
        self.graph.replay()
