"""What the runner requires of a model forward and of a request, checked before anything
changes: inputs it reads, caches that hold the state's blocks, prompts, sampling, encoders."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from graphattn.config import INPUT_NAMES, RunnerConfig
from graphattn.sampling import SamplingParams, SamplingTable
from graphattn.state import RequestState

__all__ = ["check_caches", "check_prompt", "check_sampling", "check_slots", "encode_request",
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


def check_caches(forward: Any, state: RequestState) -> None:
    """ValueError unless the model's paged caches (``forward.caches``: pairs of
    [blocks + 1, block_size, ...] tensors, when it has them) hold the state's blocks, at its
    block size, on its device."""
    caches = getattr(forward, "caches", None)
    if not isinstance(caches, list | tuple):
        return
    for layer, pair in enumerate(caches):
        for cache in pair if isinstance(pair, list | tuple) else (pair,):
            if not isinstance(cache, torch.Tensor) or cache.dim() < 2:
                continue
            want = (state.num_kv_blocks + 1, state.block_size, state.device.type)
            got = (cache.shape[0], cache.shape[1], cache.device.type)
            if got[0] < want[0] or got[1:] != want[1:]:
                raise ValueError(
                    f"{type(forward).__name__}.caches[{layer}]: {got[0]} blocks (sink "
                    f"included) of {got[1]} slots on {got[2]}, expected >= {want[0]} blocks "
                    f"(the state's num_kv_blocks = {state.num_kv_blocks} + the sink) of "
                    f"{want[1]} slots on {want[2]}")


def check_slots(forward: Any, state: RequestState) -> None:
    """ValueError when the model holds per-request state for fewer slots than the state."""
    slots = getattr(forward, "max_num_reqs", None)
    if isinstance(slots, int) and slots < state.max_num_reqs:
        raise ValueError(f"{type(forward).__name__} holds per-request state for "
                         f"max_num_reqs = {slots} slots, expected >= the state's "
                         f"{state.max_num_reqs}")


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
