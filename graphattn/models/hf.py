"""Run a transformers causal LM on graphattn's paged backend, through its own forward.

The model's own forward runs unchanged (embedding scales, per-layer rope, logit
scaling, final softcaps are the model's); attention goes through a function
registered in transformers' AttentionInterface, which reads graphattn metadata
and a paged KV cache instead of HF's cache, with each layer's own scaling,
sliding window, logit softcap and sinks. Our attention name has no mask
function, so transformers builds no mask (which would inspect positions on the
host): the whole step stays sync-free and capturable.

Families checked against their own generate() are accepted (`SUPPORTED`); any
other model is refused when wrapping, naming the class and the reason.
Wrapping leaves the user's model usable as before: its attention
implementation is switched only while our forward runs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphattn.backends.paged import PagedAttentionImpl, PagedAttentionMetadata
from graphattn.backends.reference import (
    allocate_kv_cache,
    cache_dtype,
    fp8_scales,
    is_fp8,
    layer_scales,
)
from graphattn.models.hf_dsa import SparseLatentAttention, indexer_refusal, indexers
from graphattn.models.hf_mla import LatentAttention, mla_layout

__all__ = ["ATTN_NAME", "CHECKED", "LAYER_CACHE", "SUPPORTED", "SWEPT", "HFCausalLM",
           "LayerCache", "check_supported", "learned_positions", "type_refusal"]

ATTN_NAME = "graphattn_paged"
# model types checked against the model's own generate() token for token (tests)
CHECKED = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "phi", "phi3",
           "phimoe", "olmo", "olmo2", "gemma", "gemma2", "gemma3_text", "granite", "cohere",
           "starcoder2", "gpt2", "gptj", "gpt_neox", "gpt_oss", "deepseek_v2", "deepseek_v3",
           "deepseek_v32")
# decided by `python -m bench.hf_families --sweep`: any causal-LM family in a generic tiny
# config (windows of 8 tokens) against its own generate(), tokens and logits
SWEPT = ("afmoe", "apertus", "apertus1p5_text", "arcee", "aria_text", "beam", "cohere2",
         "cohere2_moe", "dots1", "ernie4_5", "ernie4_5_moe", "exaone4", "glm", "glm4",
         "granitemoe", "hunyuan_v1_dense", "hunyuan_v1_moe", "ministral", "ministral3", "olmo3",
         "olmoe", "seed_oss", "smollm3")
SUPPORTED = CHECKED + SWEPT
# mixture-of-experts layers run transformers' "batched_mm" experts implementation while our
# forward runs: every routed (token, expert) pair gathers its expert's weights, fixed shapes,
# no host read (the default implementation finds the hit experts with nonzero)
EXPERTS_IMPLEMENTATION = "batched_mm"
# why the others are refused
_REASONS = {
    "bart": "encoder-decoder: its decoder derives positions from the cache length, not from "
            "position ids (see graphattn.models.hf_encoder_decoder)",
    "whisper": "encoder-decoder: wrap it with graphattn.models.hf_encoder_decoder."
               "HFEncoderDecoder",
    "gpt_neo": "its local-attention layers give other tokens than its generate() here",
    "gpt_bigcode": "multi-query attention is not read from its config here",
    "deepseek_v4": "compressed sparse attention with sliding windows, which no graphattn "
                   "backend implements",
    "llama4_text": "chunked local attention and attention-temperature tuning past lengths "
                   "the checks reach",
    "diffllama": "differential attention (two softmax maps subtracted), which the paged "
                 "attention does not compute",
    "dots3_note_text": "a lightning indexer's top-k selection applied through the attention "
                       "mask, which the wrapper does not build (the sparse-indexer backend "
                       "is wired for DeepSeek-V3.2 only)",
    "gemma3n_text": "layers that read another layer's KV cache (KV sharing), which the paged "
                    "cache of one layer per layer does not model",
}
_UNCHECKED = ("not among the families checked against generate() (`python -m "
              "bench.hf_families --sweep --only TYPE` runs one)")
# families whose layers keep a recurrent state instead of (or beside) a KV cache
_RECURRENT = ("mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "falcon_h1", "zamba",
              "zamba2", "granitemoehybrid", "nemotron_h", "lfm2", "lfm2_moe", "qwen3_next",
              "minimax", "rwkv", "recurrent_gemma", "xlstm", "plamo2", "hunyuan_v1_moe_hybrid")


def check_supported(model: nn.Module) -> None:
    """Raise ValueError naming the class and the feature unless `model` runs right here."""
    cfg = model.config
    name, mtype = type(model).__name__, getattr(cfg, "model_type", "?")
    head = _causal_lm_class(mtype)
    if mtype in SUPPORTED and head is not None and name != head:
        raise ValueError(f"{name} (model_type {mtype!r}) is not a causal-LM head: "
                         f"graphattn.models.hf serves {head}, whose logits it samples")
    refusal = _config_refusal(cfg) or indexer_refusal(model) if mtype in SUPPORTED else None
    if refusal is not None:
        raise ValueError(f"{name} (model_type {mtype!r}) is not supported with this config: "
                         f"{refusal}")
    if mtype not in SUPPORTED:
        reason = type_refusal(mtype, getattr(cfg, "is_encoder_decoder", False))
        raise ValueError(
            f"{name} (model_type {mtype!r}) is not supported by graphattn.models.hf: "
            f"{reason}; supported: {', '.join(SUPPORTED)}"
        )


def type_refusal(model_type: str, is_encoder_decoder: bool = False) -> str | None:
    """Why a model type is refused when wrapping (None: a supported type, whose configs
    `check_supported` still checks)."""
    if model_type in SUPPORTED:
        return None
    reason = _REASONS.get(model_type)
    if reason is None and model_type in _RECURRENT:
        reason = ("state-space / linear-attention layers keep a recurrent state, not a KV "
                  "cache, and no graphattn backend holds one")
    if reason is None and is_encoder_decoder:
        reason = "encoder-decoder: only those of graphattn.models.hf_encoder_decoder are supported"
    return reason or _UNCHECKED


# rope variants whose factors depend on the longest position of the whole step (so one
# request's output would depend on its batchmates), or that read it on the host
_ROPE_REFUSED = {
    "dynamic": "dynamic NTK rope recomputes its frequencies from the longest position of the "
               "step on the device (a host read, and one request's factors would depend on "
               "its batchmates)",
    "longrope": "long-rope picks short or long factors from the longest position of the whole "
                "step, so a request's tokens would depend on its batchmates",
}


def _config_refusal(cfg: Any) -> str | None:
    """Why a supported family's config would run wrong here, or None."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    nested = isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values())
    for params in (rope.values() if nested else [rope]):
        kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
        if kind in _ROPE_REFUSED:
            return f"rope_type {kind!r}: {_ROPE_REFUSED[kind]}"
    mask_window = (cfg.model_type == "qwen2_moe" and getattr(cfg, "use_sliding_window", False)
                   ) or (cfg.model_type == "phimoe" and getattr(cfg, "sliding_window", None))
    if mask_window:
        return ("its sliding window is applied only through the attention mask, which "
                "graphattn does not build (every request would attend past the window)")
    return None


def _causal_lm_class(model_type: str) -> str | None:
    """transformers' causal-LM class name of a model type (None when it has none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def _graphattn_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                         dropout: float = 0.0, sliding_window: int | None = None,
                         softcap: float | None = None, s_aux: torch.Tensor | None = None,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    ctx: HFCausalLM = kwargs["graphattn_runner"]
    if ctx.latent is not None:  # multi-head latent attention (DeepSeek)
        nope = ctx.latent.layout.qk_nope_head_dim
        out = ctx.latent(module, query[0], key[0, 0, :, nope:], scaling,
                         ctx.layer_cache(module)[0], kwargs["graphattn_metadata"],
                         kwargs.get("indices"))
        return out.unsqueeze(0), None
    # [1, H, T, D] to [T, H, D] through the token-major layout the projections wrote: a
    # plain view for inductor, with no guard on T (selecting first specializes T == 1)
    q = query.transpose(1, 2)[0]
    cross = getattr(ctx, "cross_layer_of", ())  # no id() of a decoder-only model's layers:
    if cross and id(module) in cross:  # dynamo would guard on it (one compile per layer)
        out = ctx.cross_attention(module, q, scaling, kwargs["graphattn_cross_metadata"])
        return out.unsqueeze(0), None
    k = key.transpose(1, 2)[0]
    v = value.transpose(1, 2)[0]
    kv, scales = ctx.layer_cache(module)
    impl = ctx.impl_for(module, scaling, sliding_window, softcap, s_aux, scales)
    out = impl.forward(q, k, v, kv, kwargs["graphattn_metadata"])
    return out.unsqueeze(0), None


@dataclass(slots=True)
class LayerCache:
    """One attention layer's paged K/V caches and fp8 scales, held by the layer's module
    (attribute `LAYER_CACHE`) for the wrapper that allocated them (`owner`).

    The attention function reads them from the module it is called with instead of
    indexing the wrapper's lists by ``module.layer_idx``: an int attribute of a module,
    which torch.compile specializes, so a regional compile of one decoder layer
    (`CompileConfig(regions="blocks")`) would compile once per layer. Pickles (and deep
    copies) as None: a saved or copied model holds no caches.
    """

    owner: Any
    kv: tuple[torch.Tensor, torch.Tensor]
    scales: tuple[float, float]

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return type(None), ()


LAYER_CACHE = "graphattn_layer_cache"


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _graphattn_attention)


def _check_inference(model: nn.Module) -> None:
    if model.training:
        raise ValueError(f"{type(model).__name__} is in training mode (dropout on): call "
                         "model.eval() before serving it")


def learned_positions(model: nn.Module) -> int | None:
    """Positions a model with learned absolute position embeddings can take (GPT-2's
    ``n_positions``), or None when its positions are not a table (rotary, ALiBi)."""
    sizes = [m.num_embeddings for name, m in model.named_modules()
             if isinstance(m, nn.Embedding) and name.rsplit(".", 1)[-1] in (
                 "wpe", "embed_positions", "position_embeddings")]
    return min(sizes) if sizes else None


class HFCausalLM:
    """`graphattn.capture.runner.ModelForward` around a transformers causal LM.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM of the `SUPPORTED` families in eval mode, run through its own
        forward (the wrapper changes nothing of it); others are refused
        (`check_supported`).
    unchecked : bool
        Skip `check_supported` (how `python -m bench.hf_families --sweep` decides families
        by running them; a family that is not accepted may give other tokens).

    Attributes
    ----------
    max_positions : int or None
        Positions its learned position table holds (the runner refuses a longer
        max_model_len); None for rotary models.
    static_input_names : tuple of str
        What the runner passes; with "logits_indices" (models whose forward takes
        ``logits_to_keep``) the LM head runs only at the rows that are sampled.
    keep_hidden_states : bool
        Set by a runner whose draft head reads the target's hidden states: each call then
        asks the model for ``output_hidden_states`` and leaves the last entry (the final
        norm's output, [T, hidden]) in ``last_hidden_states``.
    """

    backends = ("paged",)
    static_input_names: tuple[str, ...] = ("input_ids", "positions")

    def __init__(self, model: nn.Module, *, unchecked: bool = False) -> None:
        if not unchecked:
            self.check(model)
        _check_inference(model)
        _register()
        self.model = model
        self.max_positions = learned_positions(model)
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            # the LM head runs only at the rows the runner samples
            self.static_input_names = (*type(self).static_input_names, "logits_indices")
        cfg = model.config
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.caches: list[Any] = []
        self.keep_hidden_states = False
        self.last_hidden_states: torch.Tensor | None = None
        self._scales = layer_scales(None, self.num_layers, False)
        layout = mla_layout(model)
        self.latent: LatentAttention | None = None
        if layout is not None and indexers(model):  # DeepSeek sparse attention
            self.latent, self.backends = SparseLatentAttention(model, layout), ("sparse_indexer",)
        elif layout is not None:
            self.latent, self.backends = LatentAttention(model, layout), ("mla",)

    @staticmethod
    def check(model: nn.Module) -> None:
        """`check_supported`: refuses, when wrapping, what this class cannot run right."""
        check_supported(model)

    def impl_for(self, module: nn.Module, scaling: float | None, window: int | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None,
                 scales: tuple[float, float] | None = None) -> PagedAttentionImpl:
        """The paged impl of a layer's attention features (`scales`: its fp8 cache's,
        default the layer's own).

        A new (stateless, cheap) object per call rather than a cache: a compiled step then
        holds no side effect that its next call would guard on and recompile for."""
        s = float(scaling if scaling is not None else self.head_dim ** -0.5)
        k_scale, v_scale = scales or self.layer_cache(module)[1]
        return PagedAttentionImpl(self.num_heads, self.head_dim, self.num_kv_heads, scale=s,
                                  window=int(window or 0), softcap=float(softcap or 0.0),
                                  sinks=sinks, k_scale=k_scale, v_scale=v_scale)

    def layer_cache(self, module: nn.Module) -> tuple[Any, tuple[float, float]]:
        """(K/V caches, fp8 scales) of an attention `module`: its `LayerCache` when this
        wrapper set it, else by the module's ``layer_idx``."""
        entry = getattr(module, LAYER_CACHE, None)
        if entry is not None and entry.owner is self:
            return entry.kv, entry.scales
        idx = getattr(module, "layer_idx", 0)
        return self.caches[idx], self._scales[idx]

    def allocate_caches(self, num_blocks: int, block_size: int,
                        kv_cache_dtype: torch.dtype | str | None = None,
                        kv_scales: Any = None) -> None:
        """Paged caches of `num_blocks` (+ the sink) per layer, in the model's dtype or
        `kv_cache_dtype` ("fp8_e4m3": the paged backend only), with `kv_scales` for an fp8
        cache: one (k_scale, v_scale) pair for every layer or one per layer (it stores
        K / k_scale, V / v_scale; `kv_scales()` measures them on a calibration run), 1 by
        default."""
        p = next(self.model.parameters())
        if kv_cache_dtype is not None and self.latent is not None:
            raise ValueError(f"kv_cache_dtype = {kv_cache_dtype}: the latent (MLA) cache of "
                             f"{type(self.model).__name__} takes the model's dtype only")
        dtype = cache_dtype(kv_cache_dtype, p.dtype)
        scales = layer_scales(kv_scales, self.num_layers, is_fp8(dtype))
        if self.latent is not None:
            self.caches = self.latent.allocate(self.num_layers, num_blocks, block_size,
                                               p.dtype, p.device)
        else:
            self.caches = [tuple(allocate_kv_cache(num_blocks, block_size, self.num_kv_heads,
                                                   self.head_dim, dtype, p.device)
                                 for _ in range(2)) for _ in range(self.num_layers)]
        self._scales = scales
        for m in self.model.modules():
            idx = getattr(m, "layer_idx", None)
            if isinstance(idx, int) and 0 <= idx < self.num_layers:
                setattr(m, LAYER_CACHE, LayerCache(self, self.caches[idx], scales[idx]))

    def kv_scales(self) -> tuple[tuple[float, float], ...]:
        """Per-layer fp8 scales fitted to what the model-dtype caches hold now
        (`graphattn.backends.reference.fp8_scales`): serve calibration prompts first, then
        ``allocate_caches(n, block_size, "fp8_e4m3", kv_scales=hf.kv_scales())``. Reads the
        device on the host."""
        if not self.caches or self.latent is not None:
            raise ValueError("kv_scales() reads the paged K/V caches: allocate_caches and "
                             "serve calibration prompts first (latent caches have none)")
        return tuple(fp8_scales(k, v) for k, v in self.caches)

    def __call__(self, inputs: dict[str, torch.Tensor],
                 attn_metadata: PagedAttentionMetadata) -> torch.Tensor:
        if not self.caches:
            raise ValueError("call allocate_caches(num_blocks, block_size) first")
        _check_inference(self.model)
        first = self.caches[0]
        first = first[0] if isinstance(first, tuple) else first
        if first.dtype != self.model.dtype and not is_fp8(first.dtype):
            raise ValueError(f"KV caches are {first.dtype} but the model is now "
                             f"{self.model.dtype}: call allocate_caches after casting the model")
        cfg = self.model.config
        user_impl = cfg._attn_implementation
        user_experts = getattr(cfg, "_experts_implementation", None)
        try:
            cfg._attn_implementation = ATTN_NAME  # only while our forward runs
            if hasattr(cfg, "_experts_implementation"):
                cfg._experts_implementation = EXPERTS_IMPLEMENTATION
            extra = {} if self.latent is None else self.latent.begin(self, attn_metadata)
            # the model's own forward: embedding scales, per-layer rope, logit scaling and
            # softcaps are the model's; no HF cache and no mask (our name has no mask
            # function, so transformers builds none)
            keep = extra if "logits_indices" not in inputs else {
                **extra, "logits_to_keep": inputs["logits_indices"]}
            if self.keep_hidden_states:
                keep["output_hidden_states"] = True
            out = self.model(input_ids=inputs["input_ids"][None],
                             position_ids=inputs["positions"][None], use_cache=False,
                             graphattn_runner=self, graphattn_metadata=attn_metadata, **keep)
            if self.keep_hidden_states:
                self.last_hidden_states = out.hidden_states[-1][0]
            return out.logits[0]
        finally:
            if self.latent is not None:
                self.latent.end()
            cfg._attn_implementation = user_impl
            if hasattr(cfg, "_experts_implementation"):
                cfg._experts_implementation = user_experts
