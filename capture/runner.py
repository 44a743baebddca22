"""Wrap an existing model forward: step() = dispatch, plan, replay, advance the mirror.

The whole device side of a step is one capturable function (`graphattn.capture.device_step`);
a graph step leaves the host with one packed H2D copy and one graph launch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from graphattn.backends import AttentionBuilder, BuilderContext
from graphattn.backends.registry import resolve_builder
from graphattn.batch import BatchPlan, plan_batch
from graphattn.buckets import BucketPolicy, PaddingStats
from graphattn.capture.data_parallel import dispatch_across_ranks
from graphattn.capture.device_step import DeviceStep, ModelForward, StepTensors
from graphattn.capture.dispatcher import GraphDispatcher
from graphattn.capture.graph_memory import GraphMemoryEstimate, fit_capture_sizes, measure_keys
from graphattn.capture.graphs import (
    CaptureReport,
    CUDAGraphManager,
    GraphNotCapturedError,
    slice_outputs,
)
from graphattn.capture.model_contract import (
    backend_of,
    check_caches,
    check_prompt,
    check_sampling,
    check_slots,
    encode_request,
    static_input_names_of,
    vocab_size_of,
)
from graphattn.capture.ownership import Ownership
from graphattn.capture.piecewise import PiecewiseCompiler
from graphattn.capture.profiling import StageProfiler
from graphattn.capture.step_output import OutputRings, StepOutput
from graphattn.cascade import plan_shared_prefix
from graphattn.checks import as_index
from graphattn.config import RunnerConfig
from graphattn.keys import BatchShape, CUDAGraphMode, GraphKey
from graphattn.proposer import DraftProposer
from graphattn.sampling import SamplingParams, SamplingTable
from graphattn.spec_decode import (
    FeedbackResult,
    RejectionFeedback,
    apply_rejections,
    check_drafts,
)
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import host_sync_allowed
from graphattn.transfer import (
    CurrentStream,
    StagingRing,
    Uploader,
    to_device,
)

logger = logging.getLogger("graphattn")
__all__ = ["GraphRunner", "StepOutput"]

# the step's logits (`StepTensors` position 0): valid until the next step, so every key's
# graph writes them into memory the keys captured after it may reuse
SCRATCH_OUTPUTS = (0,)


def _inference_mode() -> contextlib.AbstractContextManager[Any]:
    """Inference mode entered and left in C (no interrupt splits it), where torch has that."""
    guard = getattr(torch._C, "_InferenceMode", None)
    return torch.inference_mode() if guard is None else guard(True)


def _counted(error: BaseException, step: int) -> None:
    """Say that an interrupted step counts: the mirror keeps it, the truth may have it."""
    msg = (f"graphattn: step {step} was interrupted after its device work could advance the "
           "device truth, so it counts: the CPU mirror includes it (an upper bound of the "
           "truth) and its output is lost; GraphRunner.resync() makes the mirror exact "
           "(one host sync) before the scheduler reads it again")
    error.add_note(msg)
    logger.warning("%s", msg)


class GraphRunner:
    """A model runner that replays CUDA graphs from CPU upper bounds.

    Parameters
    ----------
    forward : callable
        ``forward(inputs, attn_metadata) -> logits [num_tokens, vocab]``; the model owns
        its KV caches and calls the backend impl with `attn_metadata`. `inputs` holds the
        config's `static_input_names`.
    state : RequestState
    config : RunnerConfig, optional
        Backend, graph mode, bucket policy, compile, sampling, copies, on_missing.
    builder : AttentionBuilder, optional
        Default: the config's backend's factory, given this runner's `BuilderContext`.
        ``builder.build(common, key)`` runs inside the captured step, so with a key it
        must plan from the key and do only capturable device work.
    dispatcher : GraphDispatcher, optional
        Picks each step's key; given, it replaces the config's `policy` and
        `cudagraph_mode` (which must then stay at their defaults).
    proposer : DraftProposer, optional
        Proposes drafts inside the step (`graphattn.proposer.NgramProposer`, or a draft
        model: `graphattn.capture.drafter.DraftModelProposer`) for rows the schedule gives
        drafts when step() gets no draft_token_ids; verified in the same step (and graph).
    profiler : StageProfiler, optional
        NVTX / torch.profiler ranges per stage.
    """

    def __init__(self, forward: ModelForward, state: RequestState,
                 config: RunnerConfig | None = None, *, builder: AttentionBuilder | None = None,
                 dispatcher: GraphDispatcher | None = None,
                 proposer: DraftProposer | None = None,
                 profiler: StageProfiler | None = None) -> None:
        config = RunnerConfig() if config is None else config
        if not isinstance(config, RunnerConfig):
            raise TypeError(f"config must be a RunnerConfig, got {type(config).__name__}")
        if proposer is not None and not isinstance(proposer, DraftProposer):
            raise TypeError(f"proposer {type(proposer).__name__} has no propose(token_ids, "
                            "req_slots, last_positions, num_drafts)")
        check_slots(forward, state)
        check_caches(forward, state)
        self.config, self.state = config, state
        self.static_input_names = static_input_names_of(forward, config)
        self.backend, spec = backend_of(forward, config.backend)
        self._given_dispatcher = dispatcher is not None
        self.dispatcher = d = GraphDispatcher.for_runner(
            config, state.max_model_len, state.max_num_reqs, spec.capture_support, dispatcher)
        context = BuilderContext(state.block_size, d.decode_query_len, state.max_model_len,
                                 d.length_buckets, state.device)
        self.builder = resolve_builder(spec, context, builder)
        self.profiler = profiler or StageProfiler(enabled=False)
        compiled = config.compile.enabled
        # compiled: two warm-ups compile (and autotune) whatever the first run's side effects
        # ask for; the recorded run compiles nothing (off CUDA, the last run stands for it)
        warmup = 2 + (state.device.type != "cuda") if compiled else 1
        self.graphs = CUDAGraphManager(
            self._graph_forward, state.device, on_missing=config.on_missing,
            warmup_iters=warmup, recording=self._steady_state if compiled else None,
            on_launch=self._launching, memory_limit=config.graph_memory_limit,
            scratch_outputs=SCRATCH_OUTPUTS)
        self.lazy_report = CaptureReport(device=state.device.type)
        self.piecewise = PiecewiseCompiler(forward, state.device, self.graphs.pool) if (
            self.dispatcher.piecewise_token_sizes) else None
        self.vocab_size = config.vocab_size or vocab_size_of(forward)
        sampler = SamplingTable(state.max_num_reqs, state.device) if config.sampling else None
        self.device_step = DeviceStep(
            forward, state, self.builder, self.dispatcher.decode_query_len,
            self.static_input_names, config.compile, self.vocab_size, sampler, proposer,
            self.piecewise, self.profiler, context)
        self._init_host()

    @property
    def forward(self) -> ModelForward:
        """The wrapped model forward (the device step calls it)."""
        return self.device_step.forward

    @forward.setter
    def forward(self, fn: ModelForward) -> None:
        self.device_step.forward = fn

    @property
    def sampler(self) -> SamplingTable | None:
        return self.device_step.sampler

    @property
    def token_ids(self) -> torch.Tensor:
        """int64 [max_num_reqs, max_model_len + 1]: each slot's prompt and sampled tokens."""
        return self.device_step.token_ids

    @property
    def compiler(self) -> Any:
        """The device step's `BucketCompiler` (None unless compiled)."""
        return self.device_step.compiler

    def _init_host(self) -> None:
        """Host-side step state: plans, lock, staging and the output rings."""
        st = self.state
        cuda = st.device.type == "cuda"
        self.padding = PaddingStats()
        self._plans: dict[GraphKey, BatchPlan] = {}
        self._own = Ownership("GraphRunner")
        self._staging = StagingRing(st.device)
        self._current = CurrentStream(st.device) if cuda else None
        overlap = self.config.overlap_copies and cuda
        self._uploader = Uploader(st.device) if overlap else None
        # tokens, rejections and emitted counts go to the host on one side stream
        self._outputs = OutputRings(st.max_num_reqs, st.device,
                                    self.dispatcher.decode_query_len, overlap)

    def _launching(self) -> None:
        self.device_step.advanced = True

    @contextlib.contextmanager
    def _steady_state(self) -> Iterator[None]:
        """Compiles raise inside: a graph records only code compiled (and autotuned) before."""
        with contextlib.ExitStack() as stack:
            for c in self.device_step.compilers():
                stack.enter_context(c.steady_state())
            yield


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
            Default: `RequestState.default_block_ids` (slot s: blocks s*B .. s*B+B-1,
            B = max_num_blocks_per_req, unless a live request holds some of them).
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
        sampling = check_sampling(req_id, sampling, self.sampler)
        ids = check_prompt(req_id, prompt_token_ids, self.vocab_size)
        if st.num_active >= st.max_num_reqs:
            raise ValueError(f"no free slot for {req_id!r}: all {st.max_num_reqs} slots hold "
                             "requests")
        encoded = encode_request(self.forward, req_id, encoder_inputs)
        if block_ids is None:
            block_ids = st.default_block_ids(int(ids.shape[0]))
        slot = st.add_request(req_id, int(ids.shape[0]), block_ids, num_computed_tokens)
        dev = self.device_step
        dev.token_ids[slot].zero_()  # nothing of the slot's previous occupant survives
        dev.token_ids[slot, : ids.shape[0]] = to_device(ids.astype(np.int64), st.device)
        dev.prompt_lens[slot : slot + 1].fill_(int(ids.shape[0]))
        if self.sampler is not None:
            self.sampler.set(slot, sampling)
        if encoded is not None:
            self.forward.store_encoder(slot, encoded)
        return slot

    def append_blocks(self, req_id: str, block_ids: Sequence[int] | np.ndarray) -> None:
        """More KV-cache blocks for a running request (`RequestState.append_blocks`)."""
        self.state.append_blocks(req_id, block_ids)

    def resync(self) -> None:
        """Restore the CPU mirror from the device truth after an interrupted step: one
        explicit host sync (`RequestState.resync`), needed only after an exception whose
        note says the step counts."""
        self.state.resync()

    # -- capture -----------------------------------------------------------
    def _graph_forward(self, inputs: dict[str, torch.Tensor], key: GraphKey) -> StepTensors:
        packed = inputs["packed"].to(self.state.device, non_blocking=True)  # static: no-op
        return self.device_step(packed, self._dummy_plan(key), key)

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
        """Capture every key of the config (or `keys`), largest first, from dummy runs.

        Keys already captured are skipped. Compiled runners run each key's compiled code
        (and inductor's autotuning) in the warm-up runs; the recorded run compiles nothing
        (RecompileError otherwise). With `progress`, a tqdm bar over the keys and a one-line
        summary logged to the "graphattn" logger.
        """

        check_caches(self.forward, self.state)  # the model may have changed since
        full = [k for k in (self.dispatcher.all_keys() if keys is None else keys)
                if not self.dispatcher.is_piecewise(k)]
        t0 = time.perf_counter()
        with self.profiler.range("capture"):
            report = self.graphs.capture(full, self._capture_inputs, progress=progress,
                                         summary=progress and self.piecewise is None)
            if self.piecewise is not None:
                for key in self.dispatcher.piecewise_keys():  # largest first, shared pool
                    plan = self._dummy_plan(key)
                    with self.piecewise.at_tokens(key.num_tokens_padded, capture=True):
                        self.device_step(to_device(plan.packed, self.state.device), plan, key,
                                         piecewise=True)
                report.num_piecewise = len(self.dispatcher.piecewise_keys())
                report.seconds = time.perf_counter() - t0
                if progress:
                    logger.info("%s", report)
        if keys is None and not self.config.lazy_capture:  # lazy: later keys may compile
            for c in self.device_step.compilers():
                c.freeze()
            if self.piecewise is not None:
                self.piecewise.freeze()
        return report

    @torch.inference_mode()
    def estimate_graph_memory(self, keys: Sequence[GraphKey] | None = None,
                              ) -> GraphMemoryEstimate:
        """Graph-pool bytes that capturing `keys` (default: the config's full keys) will
        take, from a dry-run capture of each key alone at its padded shapes, released
        before the next (`graphattn.capture.graph_memory`); ``.total_bytes`` is the
        estimate. It takes about as long as `capture` (compiles included, which `capture`
        then reuses) and needs the largest key's pool free. Off CUDA: kept output bytes
        only (no graph pool)."""
        full = [k for k in (self.dispatcher.all_keys() if keys is None else keys)
                if not self.dispatcher.is_piecewise(k)]
        return measure_keys(full, lambda ks: self.graphs.capture_alone(
            ks, self._capture_inputs))

    def fit_capture_sizes(self, budget_bytes: int) -> BucketPolicy:
        """Drop the largest capture and mixed token sizes until the estimated pool fits
        `budget_bytes`; the runner takes the new policy (call before `capture()`).

        Returns
        -------
        BucketPolicy
            The policy now in ``self.config.policy``.
        """
        as_index("budget_bytes", budget_bytes, 0)
        if self.graphs.keys:
            raise ValueError(f"fit_capture_sizes comes before capture(): "
                             f"{len(self.graphs.keys)} keys are captured already")
        if self._given_dispatcher:
            raise ValueError("fit_capture_sizes changes the config's policy, but this runner "
                             "was given a dispatcher")
        policy = fit_capture_sizes(self.config.policy, self.estimate_graph_memory(),
                                   budget_bytes)
        self.config = dataclasses.replace(self.config, policy=policy)
        self.dispatcher = GraphDispatcher.for_runner(
            self.config, self.state.max_model_len, self.state.max_num_reqs,
            self.dispatcher.capture_support)
        return policy

    def _capture_inputs(self, key: GraphKey) -> dict[str, torch.Tensor]:
        return {"packed": to_device(self._dummy_plan(key).packed, self.state.device)}

    def _capture_lazily(self, key: GraphKey) -> None:
        """Capture `key` after the step that first needed it ran eagerly (between steps:
        the capture's host syncs are allowed inside no_host_sync(); logged)."""
        with host_sync_allowed(), torch.inference_mode(), self.profiler.range("capture"):
            report = self.graphs.capture([key], self._capture_inputs, summary=False)
        lazy = self.lazy_report
        lazy.num_graphs += report.num_graphs
        lazy.seconds += report.seconds
        lazy.pool_bytes = report.pool_bytes
        for name in ("keys", "key_seconds", "key_pool_bytes", "over_budget"):
            getattr(lazy, name).extend(getattr(report, name))
        if report.num_graphs:
            logger.info("captured %s lazily in %.2f s (pool %.1f MiB)", key, report.seconds,
                        report.pool_bytes / 2**20)
        else:
            logger.info("%s runs eagerly: the graph pool has reached graph_memory_limit = %d "
                        "bytes", key, self.config.graph_memory_limit)

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
        padded shapes (`RunnerConfig.on_missing`); with on_missing="error" a batch that fits
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

        The schedule is validated before anything changes. An exception (Ctrl-C included)
        at any point leaves the runner usable and the CPU mirror >= the device truth:
        raised before the step's work could advance the truth, the step never happened
        (the mirror is restored); raised after, the step counts and the exception says so
        in a note (its output is lost; `resync()` makes the mirror exact). One thread at
        a time: a concurrent call raises RuntimeError.
        """
        self.device_step.advanced = False
        try:
            with self._own("step()"), _inference_mode():
                return self._step(sched, force_eager, key, group, draft_token_ids)
        except BaseException as e:
            if self.device_step.advanced:
                _counted(e, self.state.num_steps - 1)
            raise

    def _step(self, sched: SchedulerOutput, force_eager: bool, given: GraphKey | None,
              group: Any, draft_token_ids: Any) -> StepOutput:
        t0 = time.perf_counter()
        st, prof = self.state, self.profiler
        with prof.range("dispatch"):
            shape = st.batch_shape(sched, self.dispatcher.decode_query_len)
            st.check_known_tokens(sched)
            drafts = check_drafts(st, sched, draft_token_ids, self.dispatcher.decode_query_len,
                                  self.vocab_size, self.device_step.proposer is not None)
            shape, shared = self._shared_prefix(sched, shape, force_eager or given or group)
            key = self._key(shape, force_eager, given, group)
        with prof.range("prepare"):
            plan = self._plan(sched, shape, key, drafts,
                              shared if key is not None and key.shared_prefix else None)
        if key is None and not sched.num_reqs:  # nothing to run, no key to run it padded
            outs, mode, current = self._no_outputs(), CUDAGraphMode.NONE, None
        else:
            lazy = (self.config.lazy_capture and key is not None and key not in self.graphs
                    and not self.dispatcher.is_piecewise(key)
                    and key not in self.graphs.over_budget)
            # a lazy key's first step may compile (inductor syncs while compiling): it and
            # the capture after it are the key's one-time start, outside no_host_sync()
            with host_sync_allowed() if lazy else contextlib.nullcontext():
                outs, mode, current = self._launch(sched, shape, key, plan)
            if lazy:
                self._capture_lazily(key)
        with prof.range("postprocess"):
            out = self._outputs.of_step(st, sched, outs, key, mode, current,
                                        self.sampler is not None)
            self.padding.record(sched.num_reqs, plan.num_reqs_padded, plan.num_tokens,
                                plan.num_tokens_padded, shape.max_seq_len,
                                key.max_len_bucket if key else shape.max_seq_len)
        out.host_seconds = time.perf_counter() - t0
        return out

    def _key(self, shape: BatchShape, force_eager: bool, given: GraphKey | None,
             group: Any) -> GraphKey | None:
        """The step's key from CPU numbers (None: eager at the batch's own shapes)."""
        if given is not None:
            if not isinstance(given, GraphKey):
                raise ValueError(f"key must be a GraphKey, got {type(given).__name__} "
                                 f"{given!r}")
            self.dispatcher.check_fits(given, shape)
            return given
        if group is not None:
            return dispatch_across_ranks(self.dispatcher, shape, group)[0]
        key = None if force_eager else self.dispatcher.dispatch_shape(shape)
        if key is None and not force_eager and self.graphs.on_missing == "error":
            raise GraphNotCapturedError(
                f"no graph key fits the batch (reqs {shape.num_reqs}, tokens "
                f"{shape.num_tokens}, max len {shape.max_seq_len}, uniform "
                f"{shape.uniform_decode}) and on_missing='error' runs nothing eagerly")
        return key

    def _shared_prefix(self, sched: SchedulerOutput, shape: BatchShape,
                       fixed: Any) -> tuple[BatchShape, np.ndarray | None]:
        """The shape with the step's shared prefix (`graphattn.cascade`) and its group, for
        uniform-decode steps whose key the dispatcher picks (not forced, given or agreed)."""
        sizes = self.dispatcher.shared_prefix_sizes
        if not sizes or not shape.uniform_decode or fixed:
            return shape, None
        prefix, shared = plan_shared_prefix(self.state, sched.req_slots, sizes)
        if not prefix:
            return shape, None
        return dataclasses.replace(shape, shared_prefix=prefix), np.where(shared, prefix, 0)

    def _plan(self, sched: SchedulerOutput, shape: BatchShape, key: GraphKey | None,
              drafts: Any, shared: np.ndarray | None = None) -> BatchPlan:
        st = self.state
        pads = (key.num_reqs_padded, key.num_tokens_padded) if key else (None, None)
        on_device = isinstance(drafts, torch.Tensor)
        plan = plan_batch(st, sched, *pads, shape=shape,
                          draft_token_ids=None if on_device else drafts,
                          staging=self._staging, shared_rows=shared)
        if on_device:
            self.device_step.slot_drafts[to_device(sched.req_slots.astype(np.int64),
                                                   st.device)] = drafts.to(st.device,
                                                                           torch.int64)
        return plan

    def _no_outputs(self) -> StepTensors:
        """The device step's outputs for zero rows."""
        dev, q = self.state.device, self.dispatcher.decode_query_len
        sampled = torch.empty(0, dtype=torch.int64, device=dev)
        return (torch.empty(0, self.vocab_size or 0, device=dev), sampled,
                torch.empty(0, device=dev), torch.empty(0, dtype=torch.int32, device=dev),
                sampled.view(0, 1).expand(0, q))

    def _launch(self, sched: SchedulerOutput, shape: BatchShape, key: GraphKey | None,
                plan: BatchPlan) -> tuple[StepTensors, CUDAGraphMode, Any]:
        """Advance the mirror and enqueue the device work (the mirror is restored when the
        work never reached the truth's advance)."""
        st, dev = self.state, self.device_step
        piecewise = self.piecewise is not None and self.dispatcher.is_piecewise(key)
        full = key is not None and not piecewise  # replayed, or eager at the key's shapes
        replayed = full and key in self.graphs
        current = None if self._current is None else self._current()
        saved = st.checkpoint(sched)
        try:
            st.advance_mirror(sched, shape.seq_lens_upper_bound)
            with self.profiler.range("replay" if replayed else "eager", key):
                if full:
                    outs = self.graphs.replay_packed(key, "packed", plan.packed, sched.num_reqs,
                                                     self._uploader, current)
                else:
                    packed = to_device(plan.packed, st.device)
                    with (self.piecewise.at_tokens(key.num_tokens_padded) if piecewise
                          else contextlib.nullcontext()):
                        outs = dev(packed, plan, key if piecewise else None, piecewise)
                    outs = slice_outputs(outs, sched.num_reqs)
        except BaseException:
            if not dev.advanced:
                st.restore(saved)
            raise
        finally:  # the plan's copy to the device is enqueued (or never will be)
            self._staging.release((plan.num_reqs_padded, plan.num_tokens_padded), plan, current)
        mode = (CUDAGraphMode.PIECEWISE if piecewise else
                CUDAGraphMode.FULL if replayed else CUDAGraphMode.NONE)
        return outs, mode, current

    def apply_feedback(self, out: StepOutput) -> FeedbackResult:
        """Correct the CPU mirror with a step's rejected drafts (late is fine).

        Waits for that step's rejected counts (its event only), then applies them
        row by row: rows whose request finished or was preempted since are
        refused as stale, a second application as duplicate. Steps' feedback applies in
        any order, each once; another runner's output raises ValueError. Applied whole or
        not at all, even when interrupted.
        """
        if not isinstance(out, StepOutput):
            raise ValueError(f"out must be a StepOutput, got {type(out).__name__}")
        if out.feedback is None or out.rejected_host is None:
            raise ValueError("this step had no drafts: nothing to apply")
        rejected = out.rejected_host.wait().astype(np.int32)
        fb = out.feedback
        with self._own("apply_feedback()"):
            return apply_rejections(self.state, RejectionFeedback(
                fb.req_slots, fb.num_draft_tokens, rejected, fb.generations, fb.step, fb.origin))
