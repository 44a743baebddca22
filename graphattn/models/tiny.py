"""TinyDecoder: the embedded default model (RMSNorm, RoPE, GQA, SwiGLU, paged KV)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphattn.backends.linear import MAX_M  # importing it registers the small-M ops
from graphattn.backends.paged import PagedAttentionImpl, PagedAttentionMetadata
from graphattn.backends.reference import (
    allocate_kv_cache,
    cache_dtype,
    fp8_scales,
    is_fp8,
    layer_scales,
)
from graphattn.backends.rope import apply_rope, cos_sin, inv_frequencies, rope, rope_cos_sin

__all__ = ["TinyConfig", "TinyDecoder", "apply_rope", "rope", "rope_cos_sin"]


@dataclass(frozen=True, slots=True)
class TinyConfig:
    """Model shape; `tp_size` > 1 splits heads, KV heads and the MLP across ranks."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden {self.hidden_size}, heads {self.num_heads}, kv heads "
                f"{self.num_kv_heads}: hidden must divide by heads and heads by kv heads"
            )
        if self.tp_size < 1 or (self.num_kv_heads % self.tp_size
                                or self.intermediate_size % self.tp_size):
            raise ValueError(f"tp_size = {self.tp_size} must divide num_kv_heads "
                             f"{self.num_kv_heads} and intermediate_size "
                             f"{self.intermediate_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        return self.num_kv_heads // self.tp_size

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.tp_size


class _Layer(nn.Module):
    """Column-parallel qkv / up, row-parallel o / down (an all-reduce each with tp_size > 1)."""

    def __init__(self, cfg: TinyConfig, tp_group: Any = None) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg, self.tp_group = cfg, tp_group
        self.norm1 = nn.RMSNorm(h)
        self.norm2 = nn.RMSNorm(h)
        self.qkv = nn.Linear(h, (cfg.local_heads + 2 * cfg.local_kv_heads) * d, bias=False)
        self.o = nn.Linear(cfg.local_heads * d, h, bias=False)
        self.up = nn.Linear(h, 2 * cfg.local_intermediate, bias=False)
        self.down = nn.Linear(cfg.local_intermediate, h, bias=False)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        if self.cfg.tp_size > 1:
            torch.distributed.all_reduce(y, group=self.tp_group)
        return y

    def forward(self, x, positions, inv_freq, rot, attn, impl, cache):
        """`rot`: the model's (cos, sin), or None where `impl.forward_qkv` rotates itself."""
        a = self._attention(self.qkv(self.norm1(x)), positions, inv_freq, rot, attn, impl,
                            cache)
        x = x + self._reduce(self.o(a.flatten(1)))
        g, u = self.up(self.norm2(x)).chunk(2, -1)
        return x + self._reduce(self.down(nn.functional.silu(g) * u))

    def forward_small_m(self, x, delta, positions, inv_freq, rot, attn, impl, cache):
        """`forward` in five launches besides attention for a few rows: each projection a
        Triton GEMV (`graphattn.backends.linear`), the residual add and the norm before it
        in its prologue, the gated activation in the up projection's epilogue. `delta`: the
        previous layer's pending update of the residual stream `x` (None: none); returns
        (the residual stream, this layer's pending update)."""
        ops = torch.ops.graphattn
        w1, eps1 = self.norm1.weight, _eps(self.norm1, x.dtype)
        if delta is None:
            qkv = ops.norm_linear(x, w1, eps1, self.qkv.weight, False)
        else:
            x, qkv = ops.add_norm_linear(x, delta, w1, eps1, self.qkv.weight, False)
        a = self._attention(qkv, positions, inv_freq, rot, attn, impl, cache)
        o = self._reduce(ops.small_m_linear(a.flatten(1), self.o.weight))
        x, act = ops.add_norm_linear(x, o, self.norm2.weight, _eps(self.norm2, x.dtype),
                                     self.up.weight, True)
        return x, self._reduce(ops.small_m_linear(act, self.down.weight))

    def _attention(self, qkv, positions, inv_freq, rot, attn, impl, cache):
        cfg, d = self.cfg, self.cfg.head_dim
        hq, hkv = cfg.local_heads, cfg.local_kv_heads
        if rot is None:  # rotary embedding fused with the KV write
            return impl.forward_qkv(qkv, positions, inv_freq, cache, attn)
        qk = apply_rope(qkv[:, : (hq + hkv) * d].view(-1, hq + hkv, d), *rot)
        q, k = qk.split([hq, hkv], 1)
        return impl.forward(q, k, qkv[:, (hq + hkv) * d :].view(-1, hkv, d), cache, attn)


def _eps(norm: nn.RMSNorm, dtype: torch.dtype) -> float:
    """The epsilon `norm` uses on `dtype` inputs (None: the dtype's machine epsilon)."""
    return norm.eps if norm.eps is not None else torch.finfo(dtype).eps


class TinyDecoder(nn.Module):
    """A small decoder whose attention is a graphattn backend impl (paged by default).

    ``forward(inputs, attn_metadata)`` follows `graphattn.capture.runner.ModelForward`:
    inputs has "input_ids" and "positions" (int64 [T]) and, from the runner,
    "logits_indices" (int64 [R]); returns logits [R, vocab] at those rows (without
    them: [T, vocab]).
    Call `allocate_caches` before the first forward; call it under no_grad or
    inference mode (GraphRunner does), which also lets torch.compile trace it whole.

    Parameters
    ----------
    cfg : TinyConfig, optional
    impl : object, optional
        ``impl.forward(q, k, v, (k_cache, v_cache), attn_metadata)``, e.g. a
        FlexAttentionImpl; default PagedAttentionImpl. An impl with
        ``forward_qkv(qkv, positions, inv_freq, cache, attn_metadata)`` gets the fused
        projection and applies the rotary embedding itself (one launch with the KV write).
    tp_group : torch.distributed.ProcessGroup, optional
        With ``cfg.tp_size`` > 1: the tensor-parallel group whose all-reduces
        follow o and down (this rank holds its slice of heads, KV heads and MLP;
        `load_shard` fills it from a full model).

    Attributes
    ----------
    small_m : bool
        Batches of up to `graphattn.backends.linear.MAX_M` tokens run each layer's
        projections through the Triton GEMV on CUDA, with the residual add and the norm in
        the prologue and the gated activation in the epilogue
        (``torch.ops.graphattn.add_norm_linear``): five launches a layer besides attention
        instead of nine (default False: cuBLAS and inductor's norms; set it before the
        runner captures or compiles). Elsewhere the same ops run plain torch.
    """

    # the LM head runs only at the token rows the runner samples
    static_input_names = ("input_ids", "positions", "logits_indices")

    def __init__(self, cfg: TinyConfig | None = None, impl: Any = None,
                 tp_group: Any = None) -> None:
        super().__init__()
        self.cfg = cfg or TinyConfig()
        c = self.cfg
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(_Layer(c, tp_group) for _ in range(c.num_layers))
        self.norm = nn.RMSNorm(c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.impl = impl or PagedAttentionImpl(c.local_heads, c.head_dim, c.local_kv_heads)
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.inv_freq: torch.Tensor | None = None  # float32 (not a buffer: .to(dtype) skips it)
        # with keep_hidden_states, each forward leaves its last layer's output [T, hidden]
        # (before the final norm) in last_hidden_states, for an EAGLE-style draft head
        self.keep_hidden_states = False
        self.last_hidden_states: torch.Tensor | None = None
        self.small_m = False

    @torch.no_grad()
    def load_shard(self, full: TinyDecoder, rank: int) -> TinyDecoder:
        """Copy this rank's slice of a full (tp_size 1) model's weights; returns self."""
        c, d = self.cfg, self.cfg.head_dim
        if full.cfg.tp_size != 1 or not 0 <= rank < c.tp_size:
            raise ValueError(f"load_shard needs a full model and rank in [0, {c.tp_size}), got "
                             f"tp_size {full.cfg.tp_size}, rank {rank}")
        hq, hkv, i = c.local_heads * d, c.local_kv_heads * d, c.local_intermediate
        big_q, big_kv, big_i = c.num_heads * d, c.num_kv_heads * d, c.intermediate_size
        for mine, src in zip(self.layers, full.layers, strict=True):
            w = src.qkv.weight
            mine.qkv.weight.copy_(torch.cat([
                w[rank * hq:(rank + 1) * hq],
                w[big_q + rank * hkv:big_q + (rank + 1) * hkv],
                w[big_q + big_kv + rank * hkv:big_q + big_kv + (rank + 1) * hkv]]))
            mine.o.weight.copy_(src.o.weight[:, rank * hq:(rank + 1) * hq])
            u = src.up.weight
            mine.up.weight.copy_(torch.cat([u[rank * i:(rank + 1) * i],
                                            u[big_i + rank * i:big_i + (rank + 1) * i]]))
            mine.down.weight.copy_(src.down.weight[:, rank * i:(rank + 1) * i])
            mine.norm1.load_state_dict(src.norm1.state_dict())
            mine.norm2.load_state_dict(src.norm2.state_dict())
        for name in ("embed", "norm", "lm_head"):
            getattr(self, name).load_state_dict(getattr(full, name).state_dict())
        return self

    def allocate_caches(self, num_blocks: int, block_size: int,
                        kv_cache_dtype: torch.dtype | str | None = None,
                        kv_scales: Any = None) -> None:
        """Paged K/V caches of `num_blocks` (+ the sink) per layer, in the model's dtype or
        `kv_cache_dtype` ("fp8_e4m3"), with `kv_scales` for an fp8 cache as
        `HFCausalLM.allocate_caches` takes them (default 1); one impl serves every layer, so
        it takes the largest k_scale and v_scale of the layers."""
        p = next(self.parameters())
        c = self.cfg
        dtype = cache_dtype(kv_cache_dtype, p.dtype)
        scales = layer_scales(kv_scales, c.num_layers, is_fp8(dtype))
        if kv_scales is not None and not hasattr(self.impl, "k_scale"):
            raise ValueError(f"kv_scales: the impl {type(self.impl).__name__} has no fp8 "
                             f"scales (PagedAttentionImpl has)")
        self.inv_freq = inv_frequencies(c.head_dim, c.rope_theta, p.device)
        self.caches = [tuple(allocate_kv_cache(num_blocks, block_size, c.local_kv_heads,
                                               c.head_dim, dtype, p.device) for _ in range(2))
                       for _ in range(c.num_layers)]
        if hasattr(self.impl, "k_scale"):
            self.impl.k_scale = max(k for k, _ in scales)
            self.impl.v_scale = max(v for _, v in scales)

    def kv_scales(self) -> tuple[tuple[float, float], ...]:
        """Per-layer fp8 scales fitted to what the model-dtype caches hold now (see
        `HFCausalLM.kv_scales`)."""
        if not self.caches:
            raise ValueError("kv_scales() reads the caches: allocate_caches and serve "
                             "calibration prompts first")
        return tuple(fp8_scales(k, v) for k, v in self.caches)

    def forward(self, inputs: dict[str, torch.Tensor],
                attn_metadata: PagedAttentionMetadata) -> torch.Tensor:
        if not self.caches:
            raise ValueError("call allocate_caches(num_blocks, block_size) first")
        x = self.embed(inputs["input_ids"])
        pos = inputs["positions"]
        # an impl without forward_qkv gets q and k rotated here, the angles once per forward
        rot = None if hasattr(self.impl, "forward_qkv") else cos_sin(pos, self.inv_freq)
        if self.small_m and x.shape[0] <= MAX_M:
            delta = None
            for layer, cache in zip(self.layers, self.caches, strict=True):
                x, delta = layer.forward_small_m(x, delta, pos, self.inv_freq, rot,
                                                 attn_metadata, self.impl, cache)
            x = x + delta
        else:
            for layer, cache in zip(self.layers, self.caches, strict=True):
                x = layer(x, pos, self.inv_freq, rot, attn_metadata, self.impl, cache)
        if self.keep_hidden_states:
            self.last_hidden_states = x
        # the norm before the row selection: a gather consuming the last residual add
        # would make inductor fold every residual add of the stack into cuBLAS's addmm
        # epilogue (one device copy each)
        x = self.norm(x)
        if "logits_indices" in inputs:  # the LM head only where logits are used
            x = x[inputs["logits_indices"]]
        return self.lm_head(x)

    @torch.inference_mode()
    def reference_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Dense causal forward of one sequence without any cache: [L, vocab] (tp_size 1)."""
        c = self.cfg
        if c.tp_size != 1:
            raise ValueError("reference_logits runs the full model (tp_size 1)")
        d = c.head_dim
        pos = torch.arange(token_ids.shape[0], device=token_ids.device)
        x = self.embed(token_ids)
        for layer in self.layers:
            q, k, v = layer.qkv(layer.norm1(x)).split(
                [c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d], -1)
            q = rope(q.view(-1, c.num_heads, d), pos, c.rope_theta).transpose(0, 1)
            k = rope(k.view(-1, c.num_kv_heads, d), pos, c.rope_theta).transpose(0, 1)
            v = v.view(-1, c.num_kv_heads, d).transpose(0, 1)
            rep = c.num_heads // c.num_kv_heads
            a = nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0), is_causal=True)
            x = x + layer.o(a.transpose(0, 1).flatten(1))
            g, u = layer.up(layer.norm2(x)).chunk(2, -1)
            x = x + layer.down(nn.functional.silu(g) * u)
        return self.lm_head(self.norm(x))
