"""Run a transformers encoder-decoder (Whisper) on graphattn: the decoder through its own
forward on the paged backend, cross attention through the cross backend.

Each request's encoder runs once, when it is admitted (`encode`, eager, outside any
graph), and its cross-attention K/V are projected once per decoder layer and written into
the request's own blocks of a paged cross cache (`store_encoder`). Every step then runs
the decoder only: self attention over the paged KV cache, cross attention over the cached
encoder K/V (`graphattn.backends.cross`), with the encoder lengths and blocks read on the
device by request slot, so graphs serve any mix of requests and the step stays sync-free.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from graphattn.backends.cross import CrossAttentionImpl, cached_cross_metadata
from graphattn.backends.paged import PagedAttentionMetadata
from graphattn.backends.reference import allocate_kv_cache, write_to_cache
from graphattn.checks import as_index
from graphattn.models.hf import ATTN_NAME, HFCausalLM, learned_positions

__all__ = ["ENCODER_DECODER_SUPPORTED", "HFEncoderDecoder"]

# model_type -> checked against the model's own generation token for token (tests)
ENCODER_DECODER_SUPPORTED = ("whisper",)
# the generation head each supported family is served through
_HEADS = {"whisper": "WhisperForConditionalGeneration"}
_BART = ("its decoder layers (self and cross attention) are not wired to the paged backend "
         "(HFEncoderDecoder wires Whisper's), and with transformers before 5.25 its decoder "
         "derives positions from the cache length, not from position ids")
_T5 = ("its relative position bias is an additive score bias per head and distance, which "
       "the paged kernels do not apply")
_REASONS = {"bart": _BART, "mbart": _BART, "marian": _BART, "t5": _T5, "mt5": _T5,
            "umt5": _T5}


class HFEncoderDecoder(HFCausalLM):
    """`graphattn.capture.runner.ModelForward` around a transformers encoder-decoder.

    Give each request's encoder input to ``GraphRunner.add_request(...,
    encoder_inputs=...)``; the runner calls `encode` before admitting it and
    `store_encoder` with its slot.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A `ENCODER_DECODER_SUPPORTED` model (WhisperForConditionalGeneration);
        others are refused naming the class and the reason.
    max_num_reqs : int
        Request slots (the runner's state): each owns the cross-cache blocks of
        one encoder output of ``config.max_source_positions`` positions.
    """

    static_input_names = ("input_ids", "positions", "req_slots")

    def __init__(self, model: nn.Module, max_num_reqs: int) -> None:
        super().__init__(model)
        cfg = model.config
        max_num_reqs = as_index("max_num_reqs", max_num_reqs, 1, 1 << 20)
        self.num_layers = cfg.decoder_layers
        self.num_heads = self.num_kv_heads = cfg.decoder_attention_heads
        self.head_dim = cfg.d_model // self.num_heads
        self.max_num_reqs = max_num_reqs
        self.max_encoder_len = cfg.max_source_positions
        self.max_positions = learned_positions(model.model.decoder)
        layers = model.model.decoder.layers
        self.cross_layer_of = {id(layer.encoder_attn): i for i, layer in enumerate(layers)}
        self.cross_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def check(model: nn.Module) -> None:
        """Raise ValueError naming the class and the reason unless `model` runs here."""
        mtype = getattr(model.config, "model_type", "?")
        head = _HEADS.get(mtype)
        if head is not None and type(model).__name__ != head:
            raise ValueError(f"{type(model).__name__} (model_type {mtype!r}) is not served by "
                             f"HFEncoderDecoder: it serves {head} (encoder and decoder)")
        if mtype not in ENCODER_DECODER_SUPPORTED:
            reason = _REASONS.get(mtype, "not among the encoder-decoders checked against their "
                                         "own generation")
            raise ValueError(f"{type(model).__name__} (model_type {mtype!r}) is not supported by "
                             f"HFEncoderDecoder: {reason}; supported: "
                             f"{', '.join(ENCODER_DECODER_SUPPORTED)}")

    def allocate_caches(self, num_blocks: int, block_size: int) -> None:
        """Self-attention caches of `num_blocks`, and cross caches for every slot."""
        super().allocate_caches(num_blocks, block_size)
        p = next(self.model.parameters())
        per_slot = -(-self.max_encoder_len // block_size)
        self.block_size = block_size
        self.cross_caches = [tuple(allocate_kv_cache(self.max_num_reqs * per_slot, block_size,
                                                     self.num_heads, self.head_dim, p.dtype,
                                                     p.device) for _ in range(2))
                             for _ in range(self.num_layers)]
        self.cross_table = torch.arange(self.max_num_reqs * per_slot, dtype=torch.int32,
                                        device=p.device).view(self.max_num_reqs, per_slot)
        self.encoder_lens = torch.zeros(self.max_num_reqs, dtype=torch.int32, device=p.device)
        self._no_encoder_states = torch.zeros(1, 1, self.model.config.d_model, dtype=p.dtype,
                                              device=p.device)

    @torch.inference_mode()
    def encode(self, encoder_inputs: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run the encoder once and project each decoder layer's cross K/V.

        Parameters
        ----------
        encoder_inputs : array-like
            Whisper input features, float [num_mel_bins, 2 * max_source_positions]
            (a leading batch dimension of 1 is accepted).

        Returns
        -------
        list of (k, v)
            Per decoder layer, each [encoder_len, heads, head_dim] in the model's dtype.
        """
        if not self.cross_caches:
            raise ValueError("call allocate_caches(num_blocks, block_size) first")
        cfg = self.model.config
        want = (cfg.num_mel_bins, 2 * cfg.max_source_positions)
        x = encoder_inputs if torch.is_tensor(encoder_inputs) else np.asarray(encoder_inputs)
        floating = x.is_floating_point() if torch.is_tensor(x) else x.dtype.kind == "f"
        if not floating:
            raise ValueError(f"encoder_inputs must be float input features of shape {want}, got "
                             f"{type(encoder_inputs).__name__} of dtype {x.dtype}")
        x = torch.as_tensor(x)
        if x.dim() == 3 and x.shape[0] == 1:
            x = x[0]
        if tuple(x.shape) != want:
            raise ValueError(f"encoder_inputs must be float input features of shape {want}, got "
                             f"shape {tuple(x.shape)} dtype {x.dtype}")
        p = next(self.model.parameters())
        enc = self.model.model.encoder(x[None].to(p.device, p.dtype)).last_hidden_state[0]
        out = []
        for layer in self.model.model.decoder.layers:
            attn = layer.encoder_attn
            out.append(tuple(proj(enc).view(enc.shape[0], self.num_heads, self.head_dim)
                             for proj in (attn.k_proj, attn.v_proj)))
        return out

    @torch.inference_mode()
    def store_encoder(self, slot: int, encoded: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write `encode`'s K/V into the cross-cache blocks of request slot `slot`."""
        n = encoded[0][0].shape[0]
        e = torch.arange(n, device=self.cross_table.device)
        slots = self.cross_table[slot][e // self.block_size].long() * self.block_size + (
            e % self.block_size)
        for (kc, vc), (k, v) in zip(self.cross_caches, encoded, strict=True):
            write_to_cache(kc, slots, k)
            write_to_cache(vc, slots, v)
        self.encoder_lens[slot : slot + 1].fill_(n)

    def cross_attention(self, module: nn.Module, q: torch.Tensor, scaling: float | None,
                        meta: Any) -> torch.Tensor:
        """Cross attention of decoder layer `module` over the cached encoder K/V, with the
        scaling the layer passes (Whisper scales q itself and passes 1.0)."""
        s = float(scaling if scaling is not None else self.head_dim ** -0.5)
        cache = self.cross_caches[self.cross_layer_of[id(module)]]
        # a new (stateless) impl per call, as `HFCausalLM.impl_for`
        return CrossAttentionImpl(self.num_heads, self.head_dim, scale=s).forward(
            q, None, None, cache, meta)

    def __call__(self, inputs: dict[str, torch.Tensor],
                 attn_metadata: PagedAttentionMetadata) -> torch.Tensor:
        if not self.cross_caches:
            raise ValueError("call allocate_caches(num_blocks, block_size) first")
        slots = inputs["req_slots"]
        cross = cached_cross_metadata(attn_metadata.query_start_loc, self.encoder_lens[slots],
                                      self.cross_table[slots], self.max_encoder_len,
                                      self.block_size)
        cfg = self.model.config
        user_impl = cfg._attn_implementation
        cfg._attn_implementation = ATTN_NAME  # only while our forward runs
        try:
            # the decoder's own forward; the cross layers get a one-token stand-in for the
            # encoder states (their K/V come from the cross cache in our attention)
            out = self.model(encoder_outputs=(self._no_encoder_states,),
                             decoder_input_ids=inputs["input_ids"][None],
                             decoder_position_ids=inputs["positions"][None], use_cache=False,
                             graphattn_runner=self, graphattn_metadata=attn_metadata,
                             graphattn_cross_metadata=cross)
            return out.logits[0]
        finally:
            cfg._attn_implementation = user_impl
