"""What the runner requires of a model forward and of a request, checked before anything
changes: inputs it reads, caches that hold the state's blocks, prompts, sampling, encoders."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from graphattn.backends.reference import is_fp8
from graphattn.backends.registry import BackendSpec, get_backend
from graphattn.config import INPUT_NAMES, RunnerConfig
from graphattn.sampling import SamplingParams, SamplingTable
from graphattn.state import RequestState

__all__ = ["backend_of", "check_backend", "check_caches", "check_prompt", "check_sampling",
           "check_slots", "encode_request", "model_dtype", "same_device",
           "static_input_names_of", "vocab_size_of"]


def vocab_size_of(forward: Any) -> int | None:
    for holder in (forward, getattr(forward, "model", None)):
        for attr in ("cfg", "config"):
            v = getattr(getattr(holder, attr, None), "vocab_size", None)
            if isinstance(v, int):
                return v
    return None


def static_input_names_of(forward: Any, config: RunnerConfig) -> tuple[str, ...]:
    names = config.static_input_names
    if names is None:
        names = tuple(getattr(forward, "static_input_names", INPUT_NAMES[:2]))
    bad = set(names) - set(INPUT_NAMES)
    if bad:
        raise ValueError(f"unknown static inputs {sorted(bad)}, expected a subset of "
                         f"{INPUT_NAMES}")
    return tuple(names)


def model_dtype(forward: Any) -> torch.dtype | None:
    """The floating dtype of the model's first floating parameter (None without one)."""
    for holder in (forward, getattr(forward, "model", None)):
        if isinstance(holder, torch.nn.Module):
            for p in holder.parameters():
                if p.is_floating_point():
                    return p.dtype
    return None


def check_caches(forward: Any, state: RequestState) -> None:
    """ValueError unless the model's paged caches (``forward.caches``: pairs of
    [blocks + 1, block_size, ...] tensors, when it has them) hold the state's blocks, at its
    block size, on its device, contiguous, in the model's dtype or fp8 (a model cast after
    `allocate_caches` is caught here)."""
    caches = getattr(forward, "caches", None)
    if not isinstance(caches, list | tuple):
        return
    dtype, name = model_dtype(forward), type(forward).__name__
    for layer, pair in enumerate(caches):
        for cache in pair if isinstance(pair, list | tuple) else (pair,):
            if not isinstance(cache, torch.Tensor) or cache.dim() < 2:
                continue
            want = (state.num_kv_blocks + 1, state.block_size, state.device)
            got = (cache.shape[0], cache.shape[1], cache.device)
            if got[0] < want[0] or got[1] != want[1] or not same_device(got[2], want[2]):
                raise ValueError(
                    f"{name}.caches[{layer}]: {got[0]} blocks (sink included) of {got[1]} "
                    f"slots on {got[2]}, expected >= {want[0]} blocks (the state's "
                    f"num_kv_blocks = {state.num_kv_blocks} + the sink) of {want[1]} slots "
                    f"on {want[2]}")
            if not cache.is_contiguous():
                raise ValueError(f"{name}.caches[{layer}]: strides {cache.stride()} for shape "
                                 f"{tuple(cache.shape)}, expected a contiguous tensor")
            if dtype is not None and cache.dtype != dtype and not is_fp8(cache.dtype):
                raise ValueError(f"{name}.caches[{layer}]: dtype {cache.dtype}, expected the "
                                 f"model's {dtype} (call allocate_caches after casting the "
                                 "model)")


def same_device(got: torch.device, want: torch.device) -> bool:
    """Same type, and the same index where the state names one (cuda = the current one)."""
    if got.type != want.type:
        return False
    if want.type != "cuda":
        return True
    index = torch.cuda.current_device() if want.index is None else want.index
    return got.index in (None, index)


def backend_of(forward: Any, name: str | None) -> tuple[str, BackendSpec]:
    """The backend a model runs: `name`, else the first of its ``backends``, else "paged";
    with its registered spec, checked against the model (`check_backend`)."""
    name = name or next(iter(getattr(forward, "backends", ())), "paged")
    spec = get_backend(name)
    check_backend(forward, name, spec.impl_cls)
    return name, spec


def check_backend(forward: Any, name: str, impl_cls: type) -> None:
    """ValueError when the model cannot run the backend `name`: it lists the backends it
    runs (``forward.backends``) without it, or its attention impl (``forward.impl``) is not
    the backend's `impl_cls`."""
    name_of = type(forward).__name__
    backends = getattr(forward, "backends", None)
    if backends is not None and name not in backends:
        raise ValueError(f"RunnerConfig.backend = {name!r}, but {name_of} runs only "
                         f"{tuple(backends)}")
    impl = getattr(forward, "impl", None)
    if impl is not None and not isinstance(impl, impl_cls):
        raise ValueError(f"RunnerConfig.backend = {name!r} needs a {impl_cls.__name__}, but "
                         f"{name_of}.impl is a {type(impl).__name__} (build the model with "
                         f"the backend's impl)")


def check_slots(forward: Any, state: RequestState) -> None:
    """ValueError when the model holds per-request state for fewer slots than the state, or
    takes fewer positions (``forward.max_positions``) than its max_model_len."""
    slots = getattr(forward, "max_num_reqs", None)
    if isinstance(slots, int) and slots < state.max_num_reqs:
        raise ValueError(f"{type(forward).__name__} holds per-request state for "
                         f"max_num_reqs = {slots} slots, expected >= the state's "
                         f"{state.max_num_reqs}")
    positions = getattr(forward, "max_positions", None)
    if isinstance(positions, int) and positions < state.max_model_len:
        raise ValueError(f"the state's max_model_len = {state.max_model_len}, but "
                         f"{type(forward).__name__} takes positions below {positions} only "
                         "(its learned position table)")


def check_prompt(req_id: str, prompt_token_ids: Any, vocab_size: int | None) -> np.ndarray:
    """The prompt as a 1-D integer array, each id in [0, vocab_size)."""
    ids = np.asarray(prompt_token_ids)
    if ids.ndim != 1 or (ids.size and (ids.dtype == bool
                                       or not np.issubdtype(ids.dtype, np.integer))):
        raise ValueError(f"prompt_token_ids of {req_id!r} must be a 1-D integer sequence, got "
                         f"shape {ids.shape} dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or (vocab_size and ids.max() >= vocab_size)):
        bad = ids[(ids < 0) | (ids >= (vocab_size or np.iinfo(np.int64).max))]
        raise ValueError(f"prompt_token_ids of {req_id!r}: ids {bad[:8].tolist()} are outside "
                         f"[0, vocab_size={vocab_size}]")
    return ids


def check_sampling(req_id: str, sampling: Any, sampler: SamplingTable | None) -> SamplingParams:
    """The request's SamplingParams (default greedy); anything else than greedy needs a
    runner that samples."""
    sampling = SamplingParams() if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if sampler is None and sampling != SamplingParams():
        raise ValueError(f"request {req_id!r} asks for {sampling}, but this runner samples "
                         "greedily: build it with RunnerConfig(sampling=True)")
    return sampling


def encode_request(forward: Any, req_id: str, encoder_inputs: Any) -> Any:
    """The forward's encoding of a request's encoder input (None for a decoder-only)."""
    encode = getattr(forward, "encode", None)
    if encode is None:
        if encoder_inputs is not None:
            raise ValueError(f"request {req_id!r} has encoder_inputs, but the model "
                             f"{type(forward).__name__} has no encoder")
        return None
    if encoder_inputs is None:
        raise ValueError(f"request {req_id!r}: {type(forward).__name__} is an "
                         "encoder-decoder and needs encoder_inputs")
    return encode(encoder_inputs)
