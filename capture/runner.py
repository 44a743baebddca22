"""Wrap an existing model forward: step() = dispatch, plan, replay, advance the mirror.

The whole device side of a step (prepare's device half, metadata build,
forward, sampling, token write-back, device truth) is one capturable function;
a graph step leaves the host with one packed H2D copy and one graph launch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from graphattn.backends import AttentionBuilder, BuilderContext, get_backend
from graphattn.batch import BatchPlan, InputBatch, assemble_batch, assemble_tensors, plan_batch
from graphattn.buckets import BucketPolicy, PaddingStats
from graphattn.capture.data_parallel import dispatch_across_ranks
from graphattn.capture.dispatcher import GraphDispatcher
from graphattn.capture.graphs import (
    CaptureReport,
    CUDAGraphManager,
    GraphNotCapturedError,
    slice_outputs,
)
from graphattn.capture.piecewise import PiecewiseCompiler
from graphattn.capture.profiling import StageProfiler
from graphattn.checks import INT32_MAX, as_int32_array
from graphattn.compile import BucketCompiler
from graphattn.keys import CUDAGraphMode, GraphKey
from graphattn.metadata import build_common_metadata
from graphattn.proposer import DraftProposer
from graphattn.sampling import SamplingParams, SamplingTable
from graphattn.spec_decode import FeedbackResult, RejectionFeedback, apply_rejections
from graphattn.state import RequestState, SchedulerOutput
from graphattn.transfer import CurrentStream, StagingRing, Uploader, side_copy, to_device

__all__ = ["BucketPolicy", "GraphRunner", "ModelForward", "SamplingParams", "StepOutput",
           "TokenFuture"]

# forward(inputs, attn_metadata) -> logits [num_tokens, vocab]
ModelForward = Callable[[dict[str, torch.Tensor], Any], torch.Tensor]
STATIC_INPUTS = ("input_ids", "positions")
INPUT_NAMES = (*STATIC_INPUTS, "req_slots")


@dataclass(slots=True)
class StepOutput:
    """One step's result.

    Attributes
    ----------
    logits : torch.Tensor
        [num_reqs, vocab] at each request's last scheduled token (on CUDA a
        view of graph memory, valid until the next step).
    sampled : torch.Tensor
        int64 [num_reqs] sampled tokens (greedy unless the request's
        SamplingParams say otherwise), already written to the token buffer.
    sampled_host : TokenFuture
        The same tokens on their way to the host: ``wait()`` returns them as
        np.ndarray int64 [num_reqs], blocking on this step's event only.
    logprobs : torch.Tensor or None
        float32 [num_reqs] log-probabilities of `sampled` (runners built with
        ``sampling=True``).
    num_rejected : torch.Tensor or None
        int32 [num_reqs] drafts the verification rejected (steps with drafts).
    feedback : RejectionFeedback or None
        Slots, drafts, generations and step id of a step with drafts, waiting
        for its rejected counts: `GraphRunner.apply_feedback(out)` fills them
        from the device (blocking on this step only) and corrects the mirror.
    key : GraphKey or None
        The key whose padded shapes the step ran at; None when it ran eager at
        its own shapes (no key fits, or force_eager).
    replayed : bool
        A captured graph of `key` replayed (False: the key had none and the
        runner's on_missing="eager" ran it eagerly at the key's shapes).
    host_seconds : float
        Host time of step() (the device may still be running).
    mode : CUDAGraphMode
        How the step ran: FULL (a whole-step graph replayed), PIECEWISE (the
        pieces of the split model replayed around eager attention) or NONE (eager).
    emitted_host : TokenFuture or None
        Steps with drafts: ``wait()`` gives int64 [num_reqs, decode_query_len], the
        tokens each row produced in order (its accepted drafts, then `sampled`),
        -1 past them: what a serving loop streams, whoever proposed the drafts.
    """

    logits: torch.Tensor
    sampled: torch.Tensor
    key: GraphKey | None
    replayed: bool
    host_seconds: float
    sampled_host: TokenFuture | None = None
    logprobs: torch.Tensor | None = None
    num_rejected: torch.Tensor | None = None
    rejected_host: TokenFuture | None = None
    feedback: RejectionFeedback | None = None
    mode: CUDAGraphMode = CUDAGraphMode.NONE
    emitted_host: TokenFuture | None = None


class TokenFuture:
    """A step's sampled tokens on their way to the host.

    On CUDA a non-blocking copy into a pinned ring slot followed by an event;
    `wait()` blocks on that event alone (never on later steps). The slot is
    reused `_OutputRing.DEPTH` steps later: read a future before then (a later
    read raises instead of returning another step's tokens). Elsewhere the copy
    happens in `wait()`.
    """

    __slots__ = ("_src", "_ring", "_slot", "_version")

    def __init__(self, src: torch.Tensor, ring: _OutputRing | None = None, slot: int = 0,
                 version: int = 0) -> None:
        self._src, self._ring, self._slot, self._version = src, ring, slot, version

    def ready(self) -> bool:
        """True when `wait()` would not block."""
        return self._ring is None or self._ring.events[self._slot].query()

    def wait(self) -> np.ndarray:
        """int64 [num_reqs] (or [num_reqs, width]) tokens (blocks until this step's copy has
        landed)."""
        if self._ring is None:
            return self._src.to("cpu").numpy().astype(np.int64, copy=True)
        if self._ring.versions[self._slot] != self._version:
            raise RuntimeError(f"this step's tokens were overwritten: read a TokenFuture within "
                               f"{_OutputRing.DEPTH} steps")
        self._ring.events[self._slot].synchronize()
        return self._ring.host_np[self._slot][: self._src.shape[0]].copy()


class _OutputRing:
    """Pinned host slots (CUDA) that a step's tokens are copied into without blocking
    (`width` columns per row when given).

    With a side `stream` the current stream copies the tokens into the slot's device buffer
    (a device copy) and the host copy runs on `stream`, so the host memory's latency (about
    10 µs on the H200 box, scripts/step_copies.py) does not hold up the next step on the
    current stream; without one the host copy runs on the current stream.
    """

    DEPTH = 8

    def __init__(self, max_num_reqs: int, device: torch.device, width: int | None = None,
                 stream: torch.cuda.Stream | None = None) -> None:
        self.cuda = device.type == "cuda"
        n = self.DEPTH if self.cuda else 0
        shape = (max_num_reqs,) if width is None else (max_num_reqs, width)
        self.host = [torch.zeros(shape, dtype=torch.int64, pin_memory=True) for _ in range(n)]
        self.host_np = [h.numpy() for h in self.host]
        self.device = [torch.zeros(shape, dtype=torch.int64, device=device)
                       for _ in range(n if stream is not None else 0)]
        self.events = [torch.cuda.Event() for _ in range(n)]
        self.copied = [torch.cuda.Event() for _ in range(len(self.device))]
        self.versions = [0] * n
        self.stream = stream
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.i = 0

    def push(self, values: torch.Tensor, current: torch.cuda.Stream | None = None
             ) -> TokenFuture:
        """Send `values` (a device tensor of at most max_num_reqs rows) to the host;
        `current`: the current stream of its device, when the caller has it."""
        if not self.cuda:
            return TokenFuture(values)
        i, self.i = self.i, (self.i + 1) % self.DEPTH
        # the slot's previous copy (DEPTH steps ago) must have landed before it is reused;
        # a loop that reads tokens a step late never waits here
        self.events[i].synchronize()
        self.versions[i] += 1
        n = values.shape[0]
        if current is None:
            current = torch.cuda.current_stream(values.device)
        if self.stream is None:
            self.host[i][:n].copy_(values.long(), non_blocking=True)
            self.events[i].record(current)
            return TokenFuture(values, self, i, self.versions[i])
        views = self._views.get((i, n))
        if views is None:
            views = self._views[i, n] = (self.device[i][:n], self.host[i][:n])
        views[0].copy_(values)  # casts to int64 where needed
        self.copied[i].record(current)
        side_copy(self.stream, current, self.copied[i], views[1], views[0], self.events[i])
        return TokenFuture(values, self, i, self.versions[i])


def _vocab_size_of(forward: Any) -> int | None:
    for holder in (forward, getattr(forward, "model", None)):
        for attr in ("cfg", "config"):
            v = getattr(getattr(holder, attr, None), "vocab_size", None)
            if isinstance(v, int):
                return v
    return None


class GraphRunner:
    """A model runner that replays CUDA graphs from CPU upper bounds.

    Parameters
    ----------
    forward : callable
        ``forward(inputs, attn_metadata) -> logits [num_tokens, vocab]``; the
        model owns its KV caches and calls the backend impl with
        `attn_metadata`. `inputs` holds the `static_input_names`.
    state : RequestState
    backend : str
        Registered backend name (`graphattn.backends.backend_names()`): its
        builder factory makes the default builder, and its capture support is
        what the dispatcher honours.
    policy : BucketPolicy, optional
        Which graphs exist (ignored when `dispatcher` is given).
    static_input_names : sequence of str, optional
        Subset of ("input_ids", "positions", "req_slots"): int64 [num_tokens]
        token ids and positions, int64 [num_reqs_padded] request slot of each row
        (0 in padded rows). Default: the forward's ``static_input_names`` when it
        has one, else ("input_ids", "positions").
    builder : AttentionBuilder, optional
        Default: the backend's factory, given this runner's `BuilderContext`.
        ``builder.build(common, key)`` runs inside the captured step, so with
        a key it must plan from the key and do only capturable device work.
    on_missing : {"eager", "error"}
        A key without a graph runs eagerly at the key's padded shapes (same
        plan as its graph would use), or raises GraphNotCapturedError.
    profiler : StageProfiler, optional
        NVTX / torch.profiler ranges per stage.
    dispatcher : GraphDispatcher, optional
        Picks the key of each step (default: one made from `policy` and the
        backend's capture support).
    compile : bool
        Compile the device step with inductor (`BucketCompiler`, fullgraph), in two
        parts around the builder: prepare's device half, then the forward with
        sampling / verification, write-back and the truth's advance. Attention and
        the KV write stay opaque custom ops, so the caches are written in place; one
        compile per batch shape serves every length bucket. Steps with no key run
        uncompiled. After a full `capture()` any further compile raises
        RecompileError.
    vocab_size : int, optional
        Prompt token ids are checked against it at admission (default: the
        model's ``cfg.vocab_size`` or ``config.vocab_size`` when it has one).
    sampling : bool
        Sample on the device with each request's SamplingParams (temperature,
        top-k, top-p, seed) read from per-slot buffers, and return logprobs.
        False: greedy only (no sort of the vocabulary in the graph).
    mode : CUDAGraphMode or str
        Which graphs exist (default full_and_piecewise: full keys first, then
        piecewise keys when the policy has piecewise_token_sizes, then eager).
        Piecewise keys run the forward compiled once and split at the attention
        ops (`graphattn.capture.piecewise`), its pieces captured per padded token
        count by `capture()`.
    proposer : DraftProposer, optional
        Proposes drafts inside the step (e.g. `graphattn.proposer.NgramProposer`)
        for rows the schedule gives drafts when step() gets no draft_token_ids;
        they are verified in the same step (and graph).
    overlap_copies : bool
        On CUDA, each replayed step's packed input goes to the device and its tokens to
        the host on side streams, each behind a device copy on the current stream
        (`graphattn.transfer.Uploader`): the host memory's latency overlaps the previous
        graph instead of adding to the step (about 10 µs of GPU time per step on an H200,
        bench/RESULTS.md) at the price of more host work per step (stream switches,
        events). Set False where the host, not the GPU, bounds the step.
    """

    def __init__(self, forward: ModelForward, state: RequestState, backend: str = "paged",
                 policy: BucketPolicy | None = None,
                 static_input_names: Sequence[str] | None = None,
                 builder: AttentionBuilder | None = None, on_missing: str = "eager",
                 profiler: StageProfiler | None = None,
                 dispatcher: GraphDispatcher | None = None, compile: bool = False,
                 vocab_size: int | None = None, sampling: bool = False,
                 mode: CUDAGraphMode | str = CUDAGraphMode.FULL_AND_PIECEWISE,
                 proposer: DraftProposer | None = None, overlap_copies: bool = True) -> None:
        if static_input_names is None:
            static_input_names = getattr(forward, "static_input_names", STATIC_INPUTS)
        bad = set(static_input_names) - set(INPUT_NAMES)
        if bad:
            raise ValueError(f"unknown static inputs {sorted(bad)}, expected a subset of "
                             f"{INPUT_NAMES}")
        slots = getattr(forward, "max_num_reqs", None)
        if isinstance(slots, int) and slots < state.max_num_reqs:
            raise ValueError(f"{type(forward).__name__} holds per-request state for "
                             f"max_num_reqs = {slots} slots, expected >= the state's "
                             f"{state.max_num_reqs}")
        spec = get_backend(backend)
        self.forward = forward
        # compile: the device step around the builder, two compiled parts per batch shape
        self.compiler = BucketCompiler(self._run_compiled) if compile else None
        self._assembler = BucketCompiler(assemble_tensors) if compile else None
        self.state = state
        self.policy = policy or BucketPolicy()
        self.static_input_names = tuple(static_input_names)
        if dispatcher is None:
            dispatcher = GraphDispatcher.from_policy(self.policy, state.max_model_len,
                                                     spec.capture_support, mode,
                                                     state.max_num_reqs)
        self.dispatcher = dispatcher
        ctx = BuilderContext(state.block_size, dispatcher.decode_query_len, state.max_model_len,
                             dispatcher.length_buckets, state.device)
        self.builder = spec.make_builder(ctx) if builder is None else builder
        if not isinstance(self.builder, AttentionBuilder):
            raise TypeError(f"builder {type(self.builder).__name__} has no build(common, key)")
        self.graphs = CUDAGraphManager(self._graph_forward, state.device, on_missing=on_missing)
        self.piecewise = PiecewiseCompiler(forward, state.device, self.graphs.pool) if (
            dispatcher.piecewise_token_sizes) else None
        self.profiler = profiler or StageProfiler(enabled=False)
        self.padding = PaddingStats()
        self.vocab_size = vocab_size if vocab_size is not None else _vocab_size_of(forward)
        self._plans: dict[GraphKey, BatchPlan] = {}
        self._step_lock = threading.Lock()
        self._inference = torch.inference_mode()  # entered by step() alone (under the lock)
        self._device_advanced = False
        self.sampler = SamplingTable(state.max_num_reqs, state.device) if sampling else None
        self._staging = StagingRing(state.device)
        self._current = CurrentStream(state.device) if state.device.type == "cuda" else None
        overlap = overlap_copies and state.device.type == "cuda"
        self._uploader = Uploader(state.device) if overlap else None
        # tokens, rejections and emitted counts go to the host on one side stream
        download = torch.cuda.Stream(state.device) if overlap else None
        self._outputs = _OutputRing(state.max_num_reqs, state.device, stream=download)
        self._rejections = _OutputRing(state.max_num_reqs, state.device, stream=download)
        self._emitted = _OutputRing(state.max_num_reqs, state.device,
                                    dispatcher.decode_query_len, download)
        if proposer is not None and not isinstance(proposer, DraftProposer):
            raise TypeError(f"proposer {type(proposer).__name__} has no propose(token_ids, "
                            "req_slots, last_positions, num_drafts)")
        self.proposer = proposer
        # drafts given as a device tensor wait here by slot until the step reads them
        self.slot_drafts = torch.full((state.max_num_reqs, max(dispatcher.decode_query_len - 1,
                                                               1)), -1, dtype=torch.int64,
                                      device=state.device)
        # one spare column: sampled tokens of unfinished prefills land there
        self.token_ids = torch.zeros(state.max_num_reqs, state.max_model_len + 1,
                                     dtype=torch.int64, device=state.device)
        self.prompt_lens = torch.zeros(state.max_num_reqs, dtype=torch.int32, device=state.device)

    # -- requests ---------------------------------------------------------
    def add_request(self, req_id: str, prompt_token_ids: Sequence[int] | np.ndarray,
                    block_ids: Sequence[int] | np.ndarray | None = None,
                    num_computed_tokens: int = 0,
                    sampling: SamplingParams | None = None,
                    encoder_inputs: Any = None) -> int:
        """Admit a request and return its slot (validated whole before anything changes).

        Parameters
        ----------
        req_id : str
        prompt_token_ids : sequence of int
            1-D, each in [0, vocab_size) when the vocab size is known.
        block_ids : sequence of int, optional
            Default: slot s owns blocks s*B .. s*B+B-1 (B = max_num_blocks_per_req).
        num_computed_tokens : int
            Prompt tokens already in the KV cache (prefix-cache hit, resume after
            preemption); the step schedules the rest.
        sampling : SamplingParams, optional
            Default greedy; anything else needs a runner built with sampling=True.
        encoder_inputs : optional
            An encoder-decoder's encoder input (e.g. Whisper's input features), for a
            forward with ``encode(encoder_inputs)`` and ``store_encoder(slot,
            encoded)``: the encoder runs once here, before the request is admitted.
        """
        st = self.state
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if self.sampler is None and sampling != SamplingParams():
            raise ValueError(f"request {req_id!r} asks for {sampling}, but this runner samples "
                             "greedily: build it with GraphRunner(..., sampling=True)")
        ids = np.asarray(prompt_token_ids)
        if ids.ndim != 1 or (ids.size and (ids.dtype == bool
                                           or not np.issubdtype(ids.dtype, np.integer))):
            raise ValueError(f"prompt_token_ids of {req_id!r} must be a 1-D integer sequence, got "
                             f"shape {ids.shape} dtype {ids.dtype}")
        if ids.size and (ids.min() < 0 or (self.vocab_size and ids.max() >= self.vocab_size)):
            bad = ids[(ids < 0) | (ids >= (self.vocab_size or np.iinfo(np.int64).max))]
            raise ValueError(f"prompt_token_ids of {req_id!r}: ids {bad[:8].tolist()} are outside "
                             f"[0, vocab_size={self.vocab_size}]")
        encoded = self._encode(req_id, encoder_inputs)
        if block_ids is None:
            free = int(np.flatnonzero(~st.active_np)[0]) if st.num_active < st.max_num_reqs else 0
            b = st.max_num_blocks_per_req
            block_ids = np.arange(free * b, (free + 1) * b)
        slot = st.add_request(req_id, int(ids.shape[0]), block_ids, num_computed_tokens)
        self.token_ids[slot].zero_()  # nothing of the slot's previous occupant survives
        self.token_ids[slot, : ids.shape[0]] = to_device(ids.astype(np.int64), st.device)
        self.prompt_lens[slot : slot + 1].fill_(int(ids.shape[0]))
        if self.sampler is not None:
            self.sampler.set(slot, sampling)
        if encoded is not None:
            self.forward.store_encoder(slot, encoded)
        return slot

    def _encode(self, req_id: str, encoder_inputs: Any) -> Any:
        """The forward's encoding of a request's encoder input (None for a decoder-only)."""
        encode = getattr(self.forward, "encode", None)
        if encode is None:
            if encoder_inputs is not None:
                raise ValueError(f"request {req_id!r} has encoder_inputs, but the model "
                                 f"{type(self.forward).__name__} has no encoder")
            return None
        if encoder_inputs is None:
            raise ValueError(f"request {req_id!r}: {type(self.forward).__name__} is an "
                             "encoder-decoder and needs encoder_inputs")
        return encode(encoder_inputs)

    def append_blocks(self, req_id: str, block_ids: Sequence[int] | np.ndarray) -> None:
        """More KV-cache blocks for a running request (`RequestState.append_blocks`)."""
        self.state.append_blocks(req_id, block_ids)

    def resync(self) -> None:
        """Restore the CPU mirror from the device truth after an interrupted step.

        One explicit host sync (`RequestState.resync`); `step()` leaves mirror and
        truth consistent by itself unless it was interrupted after its device
        work was enqueued and before it returned.
        """
        self.state.resync()

    # -- the step on the device ------------------------------------------
    def _device_step(self, packed: torch.Tensor, plan: BatchPlan, key: GraphKey | None,
                     piecewise: bool = False) -> tuple[torch.Tensor | None, ...]:
        """Everything a step does on the device, from its packed buffer (capturable).

        Device half of prepare, metadata build (a key fixes the plan), forward,
        sampling, speculative verification, token write-back and the device
        truth's advance. Only `plan`'s padded sizes shape the recorded work, so
        one capture serves every live batch of its key; padded rows write into
        the spare column and advance by 0.

        Verification (keys whose rows may carry drafts): the target's token at
        every query position is sampled; a row accepts its drafts up to the
        first one that differs from the target's token there (for greedy rows
        the greedy match; for sampled rows sample-and-match, which is exact
        rejection sampling for a draft given as a token), its output is the
        target's token after the accepted drafts, and its truth advances by
        1 + accepted. `piecewise`: the key is piecewise, so the forward runs as
        the split pieces (captured per token count) around eager attention.

        Returns
        -------
        logits : [num_reqs_padded, vocab] at each row's output position;
        sampled : int64 [num_reqs_padded]; logprobs : float32 [num_reqs_padded]
        (None without a sampler); rejected : int32 [num_reqs_padded];
        emitted : int64 [num_reqs_padded, decode_query_len] (see StepOutput.emitted_host)
        """
        st = self.state
        compiled = self.compiler is not None and key is not None and not piecewise
        batch = assemble_batch(st, plan, packed, self._assembler if compiled else
                               assemble_tensors)
        with self.profiler.range("build", key):
            meta = self.builder.build(build_common_metadata(batch), key)
        spec = self.dispatcher.decode_query_len > 1 and (
            key is None or not key.uniform_decode or key.query_len > 1)
        # one token per row, row r's at index r: the logits need no gather
        single = (key is not None and key.uniform_decode
                  and key.num_tokens_padded == key.num_reqs_padded)
        if compiled:
            outs = self.compiler(batch, meta, spec, single)
        else:
            outs = self._run(batch, meta, spec, single,
                             self.piecewise if piecewise else self.forward)
        self._device_advanced = True
        return outs

    def _run_compiled(self, batch: InputBatch, meta: Any, spec: bool,
                      single: bool) -> tuple[torch.Tensor | None, ...]:
        return self._run(batch, meta, spec, single, self.forward)

    def _run(self, batch: InputBatch, meta: Any, spec: bool, single: bool,
             forward: Callable[..., torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        """Token ids in, forward, sampling, verification, write-back and the truth's advance
        (pure device work on `batch` and `meta`: compiled with the forward when compile=True).
        `single`: every row has one token, row r's at index r (a key's uniform decode), so
        the logits are the forward's own rows (no gather: at 128 rows of a 128K vocabulary
        that copy is 32 MiB).
        """
        st = self.state
        ids = self.token_ids[batch.token_slots, batch.positions]
        qsl = batch.query_start_loc.long()
        if spec:  # each token's row and offset in it (plain steps launch none of this)
            t = ids.shape[0]
            rows = batch.req_indices
            offset = torch.arange(t, device=ids.device) - qsl[rows]
            # rows with drafts but no ids from the host: the proposer's, else the ids a
            # device tensor left in `slot_drafts` (out-of-range ids count as no draft)
            drafts = batch.draft_ids.long()
            k = self.dispatcher.decode_query_len - 1
            if self.proposer is not None:
                last = batch.positions[qsl[:-1].clamp(max=max(t - 1, 0))]
                source = self.proposer.propose(self.token_ids, batch.req_slots, last, k)
            else:
                source = self.slot_drafts[batch.req_slots]
            wanted = (offset >= 1) & (offset <= batch.num_drafts.long()[rows]) & (drafts < 0)
            drafts = torch.where(wanted, source[rows, (offset - 1).clamp(0, k - 1)], drafts)
            if self.vocab_size:
                drafts = torch.where(drafts < self.vocab_size, drafts, -1)
            is_draft = drafts >= 0
            ids = torch.where(is_draft, drafts, ids)
            col = torch.where(is_draft, batch.positions, st.max_model_len)
            self.token_ids[batch.token_slots, col] = ids  # non-draft tokens: the spare column
        inputs = {}
        if "input_ids" in self.static_input_names:
            inputs["input_ids"] = ids
        if "positions" in self.static_input_names:
            inputs["positions"] = batch.positions
        if "req_slots" in self.static_input_names:
            inputs["req_slots"] = batch.req_slots
        logits_all = forward(inputs, meta)
        seq = batch.seq_lens.long()
        width = self.dispatcher.decode_query_len
        if not spec:
            if single:
                logits = logits_all[: qsl.shape[0] - 1]
            else:
                logits = logits_all[(qsl[1:] - 1).clamp(min=0)]
            sampled, logprobs = self._sample(logits, batch.req_slots, seq)
            # no row of a plain step carries drafts (num_drafts is 0 throughout), so none is
            # rejected: the input itself, not a fill launched per step
            rejected = batch.num_drafts
            emitted = sampled[:, None] if width == 1 else torch.cat(  # a view: no launch
                [sampled[:, None], sampled.new_full((sampled.shape[0], width - 1), -1)], 1)
        else:
            target, lp_all = self._sample(logits_all, batch.token_slots, batch.positions + 1)
            nxt = torch.cat([ids[1:], ids.new_full((1,), -1)])
            bad = (offset < batch.num_drafts.long()[rows]) & (target != nxt)
            first_bad = torch.full_like(seq, t).scatter_reduce(
                0, rows, torch.where(bad, offset, t), "amin")
            accepted = torch.minimum(first_bad, batch.num_drafts.long())
            rejected = (batch.num_drafts.long() - accepted).to(torch.int32)
            # a row's output follows its accepted drafts: its last token minus the rejected
            out_idx = (qsl[1:] - 1 - rejected).clamp(min=0)
            logits, sampled = logits_all[out_idx], target[out_idx]
            logprobs = None if lp_all is None else lp_all[out_idx]
            # a row emits its accepted drafts (equal to the target there), then `sampled`
            j = torch.arange(width, device=ids.device)
            at = (qsl[:-1, None] + batch.num_scheduled.long()[:, None] - 1
                  - batch.num_drafts.long()[:, None] + j).clamp(0, max(t - 1, 0))
            emitted = torch.where(j <= accepted[:, None], target[at], -1)
            seq = seq - rejected
        done = (batch.num_scheduled > 0) & (seq >= self.prompt_lens[batch.req_slots])
        col = torch.where(done, seq, st.max_model_len).clamp(max=st.max_model_len)
        self.token_ids[batch.req_slots, col] = sampled
        st.advance_device(batch.req_slots, batch.num_scheduled, rejected if spec else None)
        return logits, sampled, logprobs, rejected, emitted

    def _sample(self, logits: torch.Tensor, slots: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.sampler is None:  # greedy, no log-probabilities
            return logits.argmax(-1), None
        return self.sampler.sample(logits, slots, positions)

    def _graph_forward(self, inputs: dict[str, torch.Tensor], key: GraphKey):
        packed = inputs["packed"].to(self.state.device, non_blocking=True)  # static: no-op
        return self._device_step(packed, self._dummy_plan(key), key)

    def _dummy_plan(self, key: GraphKey) -> BatchPlan:
        """The all-padded plan of `key` (cached; its packed buffer is never written)."""
        if key not in self._plans:
            empty = SchedulerOutput(np.array([], np.int32), np.array([], np.int32))
            self._plans[key] = plan_batch(self.state, empty, key.num_reqs_padded,
                                          key.num_tokens_padded)
        return self._plans[key]

    @torch.inference_mode()
    def capture(self, keys: Sequence[GraphKey] | None = None,
                progress: bool = True) -> CaptureReport:
        """Capture every key of the policy (or `keys`), largest first, from dummy runs.

        Keys already captured are skipped. With `progress`, a tqdm bar over the
        keys (its total known before the first capture) and a one-line summary.
        """

        def make_inputs(key: GraphKey) -> dict[str, torch.Tensor]:
            return {"packed": to_device(self._dummy_plan(key).packed, self.state.device)}

        full = [k for k in (self.dispatcher.all_keys() if keys is None else keys)
                if not self.dispatcher.is_piecewise(k)]
        t0 = time.perf_counter()
        with self.profiler.range("capture"):
            report = self.graphs.capture(full, make_inputs, progress=progress,
                                         summary=progress and self.piecewise is None)
            if self.piecewise is not None:
                for key in self.dispatcher.piecewise_keys():  # largest first, shared pool
                    plan = self._dummy_plan(key)
                    with self.piecewise.at_tokens(key.num_tokens_padded, capture=True):
                        self._device_step(to_device(plan.packed, self.state.device), plan, key,
                                          piecewise=True)
                report.num_piecewise = len(self.dispatcher.piecewise_keys())
                report.seconds = time.perf_counter() - t0
                if progress:
                    tqdm.write(f"graphattn: {report}")
        if self.compiler is not None and keys is None:
            self.compiler.freeze()
            self._assembler.freeze()
        if self.piecewise is not None and keys is None:
            self.piecewise.freeze()
        return report

    @torch.inference_mode()
    def dummy_run(self, key: GraphKey) -> None:
        """Replay `key` with every row padded (slot -1, length 0): a DP rank with no work."""
        self.graphs.replay(key, {"packed": self._dummy_plan(key).packed}, 0)

    # -- steps ------------------------------------------------------------
    def step(self, sched: SchedulerOutput, force_eager: bool = False,
             key: GraphKey | None = None, group: Any = None,
             draft_token_ids: np.ndarray | Sequence[int] | None = None) -> StepOutput:
        """Run one scheduled step and advance the state (no host read of device state).

        On a graph step the host plans on CPU, copies one packed buffer into
        the graph's static input and replays; everything else runs inside the
        graph. A key without a graph raises or runs eagerly at the key's
        padded shapes (`on_missing`); with on_missing="error" a batch that fits
        no key raises too. `force_eager` runs unpadded with no key (the
        benchmarks' eager baseline).

        Data parallel: `key` runs the step padded to that key (agreed by the
        ranks; an empty schedule makes it a dummy run); `group` (a gloo process
        group) makes the runner agree on the key itself with
        `dispatch_across_ranks`, so every rank replays the same graph and the
        collectives inside match.

        Speculative decoding: rows with ``sched.num_draft_tokens`` > 0 run their last token
        plus the drafts in `draft_token_ids`: host ids, all rows' drafts flattened in batch
        order (checked against the vocabulary), or a tensor int [num_reqs, decode_query_len
        - 1] on any device (row r's first num_draft_tokens[r] used; read on the device only,
        so an id outside the vocabulary counts as a rejected draft), or, with neither, the
        runner's proposer drafts inside the step. The target verifies them inside the step
        and the device truth advances by the accepted count. The CPU mirror stays an upper
        bound until `apply_feedback(out)` (any step later).

        The step takes effect whole or not at all: the schedule is validated
        before anything changes, and the CPU mirror advances with the device
        work (rolled back if that work was never enqueued). One thread at a
        time: a concurrent call raises RuntimeError.
        """
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError("GraphRunner.step() is already running in another thread; a "
                               "runner and its state are driven by one thread")
        try:
            with self._inference:
                return self._step(sched, force_eager, key, group, draft_token_ids)
        finally:
            self._step_lock.release()

    def _step(self, sched: SchedulerOutput, force_eager: bool, given: GraphKey | None,
              group: Any, draft_token_ids: Any) -> StepOutput:
        t0 = time.perf_counter()
        st, prof = self.state, self.profiler
        with prof.range("dispatch"):
            shape = st.batch_shape(sched, self.dispatcher.decode_query_len)
            drafts = self._check_drafts(sched, draft_token_ids)
            if given is not None:
                self.dispatcher.check_fits(given, shape)
                key = given
            elif group is not None:
                key, _ = dispatch_across_ranks(self.dispatcher, shape, group)
            else:
                key = None if force_eager else self.dispatcher.dispatch_shape(shape)
            if key is None and not force_eager and self.graphs.on_missing == "error":
                raise GraphNotCapturedError(
                    f"no graph key fits the batch (reqs {shape.num_reqs}, tokens "
                    f"{shape.num_tokens}, max len {shape.max_seq_len}, uniform "
                    f"{shape.uniform_decode}) and on_missing='error' runs nothing eagerly")
            piecewise = self.piecewise is not None and self.dispatcher.is_piecewise(key)
            replayed = key is not None and key in self.graphs
        with prof.range("prepare"):
            pads = (key.num_reqs_padded, key.num_tokens_padded) if key else (None, None)
            on_device = isinstance(drafts, torch.Tensor)
            plan = plan_batch(st, sched, *pads, shape=shape,
                              draft_token_ids=None if on_device else drafts,
                              staging=self._staging)
            if on_device:
                self.slot_drafts[to_device(sched.req_slots.astype(np.int64), st.device)] = (
                    drafts.to(st.device, torch.int64))
        # the mirror advances with the device work: rolled back below if that work never ran
        st.advance_mirror(sched, shape.seq_lens_upper_bound)
        self._device_advanced = False
        current = None if self._current is None else self._current()
        try:
            with prof.range("replay" if replayed else "eager", key):
                if key is None or piecewise:
                    packed = to_device(plan.packed, st.device)
                    if piecewise:
                        with self.piecewise.at_tokens(key.num_tokens_padded):
                            outs = self._device_step(packed, plan, key, piecewise=True)
                    else:
                        outs = self._device_step(packed, plan, None)
                    outs = slice_outputs(outs, sched.num_reqs)
                else:
                    outs = self.graphs.replay_packed(key, "packed", plan.packed, sched.num_reqs,
                                                     self._uploader, current)
                    self._device_advanced = True
            # its copy to the device is enqueued
            self._staging.release((plan.num_reqs_padded, plan.num_tokens_padded), plan, current)
        except BaseException:
            if not self._device_advanced:
                st.rewind_mirror(sched)
            raise
        with prof.range("postprocess"):
            host = self._outputs.push(outs[1], current)
            feedback = rejected = emitted = None
            if sched.num_draft_tokens is not None:
                rejected = self._rejections.push(outs[3], current)
                emitted = self._emitted.push(outs[4], current)
                # rejected counts are filled in by apply_feedback once they reach the host
                feedback = RejectionFeedback.of_step(st, sched, np.zeros(sched.num_reqs, np.int32))
            self.padding.record(sched.num_reqs, plan.num_reqs_padded, plan.num_tokens,
                                plan.num_tokens_padded, shape.max_seq_len,
                                key.max_len_bucket if key else shape.max_seq_len)
        mode = (CUDAGraphMode.PIECEWISE if piecewise else
                CUDAGraphMode.FULL if replayed else CUDAGraphMode.NONE)
        return StepOutput(outs[0], outs[1], key, replayed, time.perf_counter() - t0, host,
                          outs[2] if self.sampler is not None else None,
                          outs[3] if feedback is not None else None, rejected, feedback, mode,
                          emitted)

    def _check_drafts(self, sched: SchedulerOutput, draft_token_ids: Any) -> np.ndarray | None:
        """Validate a step's drafts on the CPU (before anything changes)."""
        if sched.num_draft_tokens is None or not sched.num_draft_tokens.any():
            if draft_token_ids is not None and len(draft_token_ids):
                raise ValueError("draft_token_ids given but the schedule has no num_draft_tokens")
            return None
        if self.dispatcher.decode_query_len < 2:
            raise ValueError("drafts need a runner whose policy has decode_query_len > 1")
        if draft_token_ids is None and self.proposer is None:
            raise ValueError("sched.num_draft_tokens > 0 needs draft_token_ids (or a runner "
                             "built with a proposer)")
        most = self.dispatcher.decode_query_len - 1
        if sched.num_draft_tokens.max() > most:
            raise ValueError(f"num_draft_tokens up to {sched.num_draft_tokens.max()}, expected "
                             f"<= decode_query_len - 1 = {most}")
        st = self.state
        with_drafts = sched.num_draft_tokens > 0
        pre = st.num_computed_tokens_np[sched.req_slots] < st.num_prompt_tokens_np[sched.req_slots]
        if (with_drafts & pre).any():
            raise ValueError(f"slots {sched.req_slots[with_drafts & pre].tolist()} have drafts "
                             "before their prompt is computed")
        if draft_token_ids is None:
            return None  # the proposer drafts inside the step
        if isinstance(draft_token_ids, torch.Tensor) and (
                draft_token_ids.device.type != "cpu" or draft_token_ids.dim() == 2):
            if self.proposer is not None:
                raise ValueError("draft_token_ids as a device tensor needs a runner without a "
                                 "proposer (its proposer drafts rows given no host ids)")
            want = (sched.num_reqs, most)
            if tuple(draft_token_ids.shape) != want or draft_token_ids.is_floating_point():
                raise ValueError(f"draft_token_ids as a tensor on {draft_token_ids.device} must be "
                                 f"integer of shape {want} (rows, decode_query_len - 1), got "
                                 f"{draft_token_ids.dtype} {tuple(draft_token_ids.shape)}")
            return draft_token_ids  # written to slot_drafts by the step, read on the device
        hi = self.vocab_size - 1 if self.vocab_size else INT32_MAX
        return as_int32_array("draft_token_ids", draft_token_ids, 0, hi)

    def apply_feedback(self, out: StepOutput) -> FeedbackResult:
        """Correct the CPU mirror with a step's rejected drafts (late is fine).

        Waits for that step's rejected counts (its event only), then applies them
        row by row: rows whose request finished or was preempted since are
        refused as stale, a second application as duplicate.
        """
        if out.feedback is None or out.rejected_host is None:
            raise ValueError("this step had no drafts: nothing to apply")
        rejected = out.rejected_host.wait().astype(np.int32)
        fb = out.feedback
        return apply_rejections(self.state, RejectionFeedback(
            fb.req_slots, fb.num_draft_tokens, rejected, fb.generations, fb.step))
