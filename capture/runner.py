"""Wrap an existing model forward: step() = prepare, build, dispatch, replay, postprocess."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from capture.buckets import LengthBuckets, PaddingStats, default_capture_sizes, validate_sizes
from capture.dispatcher import GraphDispatcher, GraphKey
from capture.graphs import CaptureReport, CUDAGraphManager
from capture.profiling import StageProfiler
from graphattn.backends import AttentionBackendEnum, get_backend
from graphattn.batch import InputBatch, prepare_inputs
from graphattn.metadata import build_common_metadata
from graphattn.state import RequestState, SchedulerOutput
from graphattn.transfer import to_device

__all__ = ["BucketPolicy", "GraphRunner", "ModelForward", "StepOutput"]

# forward(inputs, attn_metadata) -> logits [num_tokens, vocab]
ModelForward = Callable[[dict[str, torch.Tensor], Any], torch.Tensor]
STATIC_INPUTS = ("input_ids", "positions")
PAD_VALUES = {"slot_mapping": -1, "query_start_loc": "edge", "cross_slot_mapping": -1}


@dataclass(frozen=True, slots=True)
class BucketPolicy:
    """Which graphs exist.

    Parameters
    ----------
    capture_sizes : tuple[int, ...]
        Padded request counts of uniform-decode graphs.
    length_boundaries : tuple[int, ...]
        Length buckets (default powers of two up to max_model_len).
    mixed_token_sizes : tuple[int, ...]
        Padded token counts of mixed prefill+decode graphs (empty: eager).
    decode_query_len : int
        1 + speculative tokens per decode row.
    """

    capture_sizes: tuple[int, ...] = field(default_factory=lambda: default_capture_sizes(16))
    length_boundaries: tuple[int, ...] = ()
    mixed_token_sizes: tuple[int, ...] = ()
    decode_query_len: int = 1

    def __post_init__(self) -> None:
        validate_sizes("capture_sizes", self.capture_sizes)
        if self.mixed_token_sizes:
            validate_sizes("mixed_token_sizes", self.mixed_token_sizes)
        if self.decode_query_len < 1:
            raise ValueError(f"decode_query_len = {self.decode_query_len}, expected >= 1")


@dataclass(slots=True)
class StepOutput:
    """One step's result.

    Attributes
    ----------
    logits : torch.Tensor
        [num_reqs, vocab] at each request's last scheduled token (on CUDA a
        view of graph memory, valid until the next step).
    sampled : torch.Tensor
        int64 [num_reqs] greedy tokens, already written to the token buffer.
    key : GraphKey or None
        The replayed graph, None when the step ran eager.
    host_seconds : float
        Host time of step() (the device may still be running).
    """

    logits: torch.Tensor
    sampled: torch.Tensor
    key: GraphKey | None
    host_seconds: float


class GraphRunner:
    """A model runner that replays CUDA graphs from CPU upper bounds.

    Parameters
    ----------
    forward : callable
        ``forward(inputs, attn_metadata) -> logits [num_tokens, vocab]``; the
        model owns its KV caches and calls the backend impl with
        `attn_metadata`. `inputs` holds the `static_input_names`.
    state : RequestState
    backend : AttentionBackendEnum or str
        Decides the metadata builder and the capture support the dispatcher honours.
    policy : BucketPolicy
    static_input_names : sequence of str
        Subset of ("input_ids", "positions").
    builder : object, optional
        Metadata builder (default: the backend's, built with the block size).
    on_missing : {"eager", "error"}
        A key without a graph runs eager, or raises.
    profiler : StageProfiler, optional
        NVTX / torch.profiler ranges per stage.
    """

    def __init__(self, forward: ModelForward, state: RequestState,
                 backend: AttentionBackendEnum | str = AttentionBackendEnum.PAGED,
                 policy: BucketPolicy | None = None,
                 static_input_names: Sequence[str] = STATIC_INPUTS, builder: Any = None,
                 on_missing: str = "eager", profiler: StageProfiler | None = None) -> None:
        bad = set(static_input_names) - set(STATIC_INPUTS)
        if bad:
            raise ValueError(f"unknown static inputs {sorted(bad)}, expected a subset of "
                             f"{STATIC_INPUTS}")
        self.forward = forward
        self.state = state
        self.policy = policy or BucketPolicy()
        self.static_input_names = tuple(static_input_names)
        spec = get_backend(backend)
        if builder is None:
            if AttentionBackendEnum(backend) != AttentionBackendEnum.PAGED:
                raise ValueError(f"backend {AttentionBackendEnum(backend).value!r} needs builder=")
            builder = spec.builder_cls(state.block_size, self.policy.decode_query_len)
        self.builder = builder
        self.dispatcher = GraphDispatcher(
            self.policy.capture_sizes,
            LengthBuckets(state.max_model_len, self.policy.length_boundaries),
            self.policy.decode_query_len, self.policy.mixed_token_sizes, spec.capture_support)
        self.graphs = CUDAGraphManager(self._graph_forward, state.device, PAD_VALUES, on_missing)
        self.profiler = profiler or StageProfiler(enabled=False)
        self.padding = PaddingStats()
        self._templates: dict[GraphKey, Any] = {}
        # one spare column: sampled tokens of unfinished prefills land there
        self.token_ids = torch.zeros(state.max_num_reqs, state.max_model_len + 1,
                                     dtype=torch.int64, device=state.device)
        self.prompt_lens = torch.zeros(state.max_num_reqs, dtype=torch.int32, device=state.device)

    # -- requests ---------------------------------------------------------
    def add_request(self, req_id: str, prompt_token_ids: Sequence[int] | np.ndarray,
                    block_ids: Sequence[int] | np.ndarray | None = None) -> int:
        """Admit a request; by default slot s owns blocks s*B .. s*B+B-1."""
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
        st = self.state
        if block_ids is None:
            free = int(np.flatnonzero(~st.active_np)[0]) if st.num_active < st.max_num_reqs else 0
            b = st.max_num_blocks_per_req
            block_ids = np.arange(free * b, (free + 1) * b)
        slot = st.add_request(req_id, int(ids.shape[0]), block_ids)
        self.token_ids[slot, : ids.shape[0]] = to_device(ids, st.device)
        self.prompt_lens[slot : slot + 1].fill_(int(ids.shape[0]))
        return slot

    @property
    def num_kv_blocks(self) -> int:
        """Blocks addressed by the default allocation (excluding the sink)."""
        return self.state.max_num_reqs * self.state.max_num_blocks_per_req

    # -- graphs -----------------------------------------------------------
    def _empty(self) -> SchedulerOutput:
        return SchedulerOutput(np.array([], np.int32), np.array([], np.int32))

    def _inputs(self, batch: InputBatch, meta: Any) -> dict[str, torch.Tensor]:
        inputs = {"logits_indices": (batch.query_start_loc[1:] - 1).clamp(min=0).long()}
        if "input_ids" in self.static_input_names:
            inputs["input_ids"] = self.token_ids[batch.token_slots, batch.positions]
        if "positions" in self.static_input_names:
            inputs["positions"] = batch.positions
        inputs.update(meta.tensors())
        return inputs

    def _run(self, inputs: dict[str, torch.Tensor], meta: Any) -> tuple[torch.Tensor, ...]:
        model_inputs = {k: inputs[k] for k in self.static_input_names}
        logits = self.forward(model_inputs, meta)[inputs["logits_indices"]]
        return logits, logits.argmax(-1)

    def _graph_forward(self, inputs: dict[str, torch.Tensor], key: GraphKey):
        return self._run(inputs, self._templates[key].with_tensors(inputs))

    def _dummy(self, key: GraphKey) -> tuple[InputBatch, Any]:
        batch = prepare_inputs(self.state, self._empty(), key.num_reqs_padded,
                               key.num_tokens_padded)
        return batch, self.builder.build(build_common_metadata(batch), key)

    def capture(self, keys: Sequence[GraphKey] | None = None) -> CaptureReport:
        """Capture every key of the policy (or `keys`), largest first, from dummy runs."""

        def make_inputs(key: GraphKey) -> dict[str, torch.Tensor]:
            batch, meta = self._dummy(key)
            self._templates[key] = meta
            return self._inputs(batch, meta)

        with self.profiler.range("capture"):
            return self.graphs.capture(self.dispatcher.all_keys() if keys is None else keys,
                                       make_inputs)

    def dummy_run(self, key: GraphKey) -> None:
        """Replay `key` with every row padded (slot -1, length 0): a DP rank with no work."""
        batch, meta = self._dummy(key)
        self.graphs.replay(key, self._inputs(batch, meta), 0)

    # -- steps ------------------------------------------------------------
    def step(self, sched: SchedulerOutput, force_eager: bool = False) -> StepOutput:
        """Run one scheduled step and advance the state (no host read of device state).

        `force_eager` skips the graphs (the benchmarks' eager baseline).
        """
        t0 = time.perf_counter()
        st, prof = self.state, self.profiler
        q = self.policy.decode_query_len
        with prof.range("dispatch"):
            bound_max = int((st.num_computed_tokens_np[sched.req_slots]
                             + sched.num_scheduled_tokens).max(initial=0))
            uniform = bool((sched.num_scheduled_tokens == q).all()) and sched.num_reqs > 0
            key = self.dispatcher.dispatch(sched.num_reqs, sched.total_num_scheduled_tokens,
                                           bound_max, uniform)
            if force_eager or (key is not None and key not in self.graphs
                               and self.graphs.on_missing == "eager"):
                key = None
        with prof.range("prepare"):
            pads = (key.num_reqs_padded, key.num_tokens_padded) if key else (None, None)
            batch = prepare_inputs(st, sched, *pads)
        with prof.range("build", key):
            meta = self.builder.build(build_common_metadata(batch), key)
            inputs = self._inputs(batch, meta)
        with prof.range("replay" if key else "eager", key):
            if key is None:
                logits, sampled = self._run(inputs, meta)
                logits, sampled = logits[: sched.num_reqs], sampled[: sched.num_reqs]
            else:
                logits, sampled = self.graphs.replay(key, inputs, sched.num_reqs)
        with prof.range("postprocess"):
            seq = batch.seq_lens[: sched.num_reqs].long()
            done = seq >= self.prompt_lens[batch.req_slots.long()]
            col = torch.where(done, seq, torch.full_like(seq, st.max_model_len))
            self.token_ids[batch.req_slots.long(), col] = sampled
            st.postprocess(sched, req_slots=batch.req_slots, num_scheduled=batch.num_scheduled)
            self.padding.record(sched.num_reqs, batch.num_reqs_padded, batch.num_tokens,
                                batch.num_tokens_padded, bound_max,
                                key.max_len_bucket if key else bound_max)
        return StepOutput(logits, sampled, key, time.perf_counter() - t0)
