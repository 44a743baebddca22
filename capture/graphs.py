"""CUDA-graph capture per GraphKey into one shared pool, and replay from static buffers."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from graphattn.backends.registry import PadValue
from graphattn.keys import GraphKey, capture_order
from graphattn.transfer import Uploader

logger = logging.getLogger("graphattn")
__all__ = ["CaptureReport", "CUDAGraphManager", "GraphNotCapturedError", "Forward",
           "kept_bytes", "slice_outputs", "unowned_view"]

Outputs = torch.Tensor | tuple[torch.Tensor | None, ...]
Forward = Callable[[dict[str, torch.Tensor], GraphKey], Outputs]


class GraphNotCapturedError(KeyError):
    """replay() was asked for a key that has no captured graph."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(slots=True)
class CaptureReport:
    """What capture() did.

    Attributes
    ----------
    num_graphs : int
        Keys captured by this call (CUDA graphs, or eager runs off CUDA).
    num_skipped : int
        Keys that already had a graph (a resumed capture).
    num_piecewise : int
        Piecewise token counts whose pieces were captured (GraphRunner).
    device : str
        Device type; graphs exist on "cuda" only.
    seconds : float
        Wall time of the whole capture, warm-up included.
    pool_bytes : int
        Device memory held by the shared graph pool (allocator segments of
        that pool); 0 off CUDA.
    keys : list[GraphKey]
        In capture order (largest first).
    key_seconds : list[float]
        Wall time of each key's capture (its warm-up runs included), in `keys` order.
    key_pool_bytes : list[int]
        The pool's size after each key's capture (0 off CUDA).
    over_budget : list[GraphKey]
        Keys not captured because the pool had reached the manager's memory limit (they
        run eagerly at their padded shapes).
    """

    num_graphs: int = 0
    num_skipped: int = 0
    num_piecewise: int = 0
    device: str = "cuda"
    seconds: float = 0.0
    pool_bytes: int = 0
    keys: list[GraphKey] = field(default_factory=list)
    key_seconds: list[float] = field(default_factory=list)
    key_pool_bytes: list[int] = field(default_factory=list)
    over_budget: list[GraphKey] = field(default_factory=list)

    def __str__(self) -> str:
        skipped = f", {self.num_skipped} already captured" if self.num_skipped else ""
        if self.over_budget:
            skipped += f", {len(self.over_budget)} over the memory limit (eager)"
        if self.num_piecewise:
            skipped += f", pieces at {self.num_piecewise} token counts"
        if self.device != "cuda":
            return (f"ran {self.num_graphs} keys eagerly: no CUDA graphs on {self.device} "
                    f"({self.seconds:.2f} s{skipped})")
        return (f"captured {self.num_graphs} graphs in {self.seconds:.2f} s, pool "
                f"{self.pool_bytes / 2**20:.1f} MiB{skipped}")


@dataclass(slots=True)
class _Captured:
    inputs: dict[str, torch.Tensor]
    outputs: Outputs
    graph: torch.cuda.CUDAGraph | None
    sliced: tuple[int, Outputs] | None = None  # the last replay's rows and output views


@contextlib.contextmanager
def _frozen_gc() -> Iterator[None]:
    # what exists now is frozen (a collection has nothing of it to walk; the young
    # generations collected first, as a full collection costs a lazily captured key about
    # a tenth of a second) and Python starts no collection until the block ends: one
    # would walk everything made since, such as compiled code loaded at a key's first
    # call, and cost a key up to 2 s
    gc.collect(1)
    gc.freeze()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.unfreeze()


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: Any,
              stream: torch.cuda.Stream) -> Iterator[None]:
    """Record the work the block enqueues into `graph` (private pool `pool`), on `stream`
    (which first waits for the current stream; the current stream waits for it after).

    ``torch.cuda.graph`` also synchronizes the device and empties the allocator's caches
    before every capture; `GraphManager.capture` does that once before its first key, and
    between captures the blocks the warm-ups cached serve the next warm-ups instead of new
    cudaMallocs.
    """
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            yield
        finally:
            graph.capture_end()
    current.wait_stream(stream)


def _new_graph(keep: bool) -> torch.cuda.CUDAGraph:
    if keep:
        try:
            return torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:  # torch without keep_graph
            pass
    return torch.cuda.CUDAGraph()


class _DeviceMemory:
    """A CUDA allocation seen through ``__cuda_array_interface__`` (bytes), owning nothing."""

    def __init__(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        # version 2: no stream, so taking the view synchronizes nothing
        self.__cuda_array_interface__ = {"shape": (storage.nbytes(),), "typestr": "|u1",
                                         "data": (storage.data_ptr(), False), "version": 2,
                                         "strides": None}


def unowned_view(t: torch.Tensor) -> torch.Tensor:
    """A view of CUDA tensor `t`'s memory that does not keep the allocation alive: once
    every owning reference is gone, the allocator may hand the memory out again (in a graph
    pool: to a later capture), and the view sees whatever is written there."""
    raw = torch.as_tensor(_DeviceMemory(t), device=t.device)
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


def _release(outputs: Outputs, scratch: tuple[int, ...]) -> Outputs:
    """`outputs` with the tensors at `scratch` replaced by `unowned_view`s."""
    if not scratch or isinstance(outputs, torch.Tensor):
        return outputs
    return tuple(unowned_view(o) if i in scratch and o is not None else o
                 for i, o in enumerate(outputs))


def kept_bytes(outputs: object, scratch: tuple[int, ...] = ()) -> int:
    """Bytes of the distinct allocations behind `outputs` (a tensor or a tuple), leaving
    out the tuple positions in `scratch`."""
    tensors = (outputs if isinstance(outputs, tuple) else (outputs,))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for i, t in enumerate(tensors)
                if isinstance(t, torch.Tensor) and not (isinstance(outputs, tuple)
                                                        and i in scratch)}
    return sum(storages.values())


def _copyable(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Same device, or a host tensor copied without blocking (pinned, for CUDA)."""
    if src.device == dst.device:
        return True
    return src.device.type == "cpu" and (dst.device.type != "cuda" or src.is_pinned())


def slice_outputs(out: Outputs, rows: int) -> Outputs:
    """The first `rows` rows of each output (absent outputs stay None)."""
    if isinstance(out, torch.Tensor):
        return out[:rows]
    return tuple(None if o is None else o[:rows] for o in out)


class CUDAGraphManager:
    """Captures `forward` once per GraphKey and replays it.

    Parameters
    ----------
    forward : callable
        ``forward(inputs, key) -> Tensor | tuple[Tensor, ...]``. `inputs` maps
        names to tensors whose shapes are fixed by `key`; every shape decision
        inside must come from `key` (Python ints), never from tensor data.
    device : torch.device or str
        On CUDA, graphs are captured; elsewhere the same static-buffer path
        runs `forward` eagerly (so CPU tests check the padding semantics).
    pad_values : mapping of str to number or "edge"
        Sentinel written into rows of a static buffer that the live input does
        not cover (default 0; use -1 for slot mappings, "edge" to repeat the
        last row, e.g. for query_start_loc).
    on_missing : {"error", "eager"}
        What `replay` does for a key without a graph: raise
        GraphNotCapturedError, or run `forward` eagerly on the live inputs.
    warmup_iters : int
        Eager runs (on a side stream) before each capture; off CUDA, runs per key (at
        least one), the last standing for the recorded one.
    recording : callable, optional
        ``recording()`` -> a context manager entered around the recorded run of each key,
        e.g. one in which compiles raise.
    on_launch : callable, optional
        ``on_launch()`` runs right before a captured graph is launched (the caller's mark
        that the graph's work may have been enqueued).
    memory_limit : int, optional
        Pool bytes (`pool_bytes`) at which capture stops taking new keys.
    scratch_outputs : tuple of int
        Positions of tuple outputs that every replay writes whole and that no one reads past
        the next replay of any key (the runner's logits). After a key's capture the manager
        keeps only a non-owning view of them, so the keys captured after it may reuse their
        memory: the pool holds one key's worth of them, not one per key.
    """

    def __init__(
        self,
        forward: Forward,
        device: torch.device | str,
        pad_values: Mapping[str, PadValue] | None = None,
        on_missing: Literal["error", "eager"] = "error",
        warmup_iters: int = 1,
        recording: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
        on_launch: Callable[[], None] | None = None,
        memory_limit: int | None = None,
        scratch_outputs: tuple[int, ...] = (),
    ) -> None:
        if on_missing not in ("error", "eager"):
            raise ValueError(f"on_missing = {on_missing!r}, expected 'error' or 'eager'")
        if warmup_iters < 0:
            raise ValueError(f"warmup_iters = {warmup_iters}, expected >= 0")
        self.forward = forward
        self.device = torch.device(device)
        self.pad_values = dict(pad_values or {})
        self.on_missing = on_missing
        self.warmup_iters = warmup_iters
        self.recording = recording or contextlib.nullcontext
        self.on_launch = on_launch
        self.memory_limit = memory_limit
        self.scratch_outputs = scratch_outputs
        self.over_budget: set[GraphKey] = set()
        self._reserved0: int | None = None
        self.use_graphs = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # warm-ups and captures run here (a capture cannot use the legacy default stream)
        self._side_stream = torch.cuda.Stream(self.device) if self.use_graphs else None
        self._captured: dict[GraphKey, _Captured] = {}
        self.keep_graphs = False  # keep each cudaGraph_t (for inspection: node counts)
        self.num_replays = 0
        self.num_eager = 0

    @property
    def keys(self) -> list[GraphKey]:
        return list(self._captured)

    def __contains__(self, key: object) -> bool:
        return key in self._captured

    def capture(
        self,
        keys: Iterable[GraphKey],
        make_inputs: Callable[[GraphKey], dict[str, torch.Tensor]],
        progress: bool = False,
        summary: bool | None = None,
    ) -> CaptureReport:
        """Capture every key, largest first, into the shared pool.

        Keys that already have a graph are skipped, so a capture interrupted by
        a fault can be resumed by calling this again.

        Parameters
        ----------
        keys : iterable of GraphKey
        make_inputs : callable
            ``make_inputs(key)`` -> dummy inputs of that key's shapes, built
            from CPU numbers only (all rows padded: slot -1, length 0). They
            become the graph's static buffers.
        progress : bool
            A tqdm bar over the keys (total shown before the first capture).
        summary : bool, optional
            Log the report's one-line summary (logger "graphattn", INFO) at the end (default:
            `progress`).
        """
        order = sorted(set(keys), key=capture_order,
                       reverse=True)
        todo = [k for k in order if k not in self._captured]
        report = CaptureReport(num_skipped=len(order) - len(todo), device=self.device.type,
                               keys=todo)
        t0 = time.perf_counter()
        if self.use_graphs and self._reserved0 is None:
            # once before the first capture (not per key, see `capturing`; not before a lazy
            # key, whose later steps would pay for the cudaMallocs), so the difference below
            # is the pool and static buffers alone
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self._reserved0 = torch.cuda.memory_reserved(self.device)
        verb = "capture" if self.use_graphs else f"eager on {self.device.type}"
        with _frozen_gc(), tqdm(todo, desc=f"graphattn {verb}", unit="key",
                                disable=not progress or not todo, leave=False) as bar:
            for key in bar:
                if self.memory_limit is not None and self.pool_bytes() >= self.memory_limit:
                    self.over_budget.add(key)
                    report.over_budget.append(key)
                    continue
                t = time.perf_counter()
                inputs = {k: v.clone() for k, v in make_inputs(key).items()}
                self._captured[key] = self._capture_one(key, inputs)
                report.key_seconds.append(time.perf_counter() - t)
                report.key_pool_bytes.append(self.pool_bytes())
                report.num_graphs += 1
        report.keys = [k for k in todo if k in self._captured]
        # the pool only grows at a capture: after the last one it is that key's figure
        report.pool_bytes = (report.key_pool_bytes[-1] if report.key_pool_bytes
                             else self.pool_bytes())
        report.seconds = time.perf_counter() - t0
        if progress if summary is None else summary:
            logger.info("%s", report)
        return report

    def pool_bytes(self) -> int:
        """Bytes of the allocator segments that belong to the shared graph pool (0 off
        CUDA; synchronizes the device)."""
        if not self.use_graphs or self._reserved0 is None:
            return 0
        return self._segment_bytes(self.pool, self._reserved0)

    def _segment_bytes(self, pool: Any, reserved0: int) -> int:
        """Bytes of `pool`'s segments; where the allocator's snapshot has no pool ids, the
        growth of reserved memory since `reserved0`."""
        torch.cuda.synchronize(self.device)
        segments = torch.cuda.memory_snapshot()
        if segments and "segment_pool_id" in segments[0]:
            return sum(s["total_size"] for s in segments
                       if tuple(s["segment_pool_id"]) == tuple(pool))
        return max(torch.cuda.memory_reserved(self.device) - reserved0, 0)

    def capture_alone(self, keys: Sequence[GraphKey],
                      make_inputs: Callable[[GraphKey], dict[str, torch.Tensor]],
                      ) -> list[tuple[int, int]]:
        """Capture each key into a pool of its own as `capture` would (warm-ups, recording),
        measure it, and release it: the manager's graphs and pool stay as they were.

        Returns
        -------
        list of (pool_bytes, kept_bytes)
            Per key of `keys`: the bytes of its pool's segments (0 off CUDA, where the
            forward runs once), and of the outputs its graph keeps (all but
            `scratch_outputs`).
        """
        with _frozen_gc():
            return [self._alone(key, {k: v.clone() for k, v in make_inputs(key).items()})
                    for key in keys]

    def _alone(self, key: GraphKey, inputs: dict[str, torch.Tensor]) -> tuple[int, int]:
        if not self.use_graphs:
            return 0, kept_bytes(self.forward(inputs, key), self.scratch_outputs)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved0 = torch.cuda.memory_reserved(self.device)
        shared, self.pool = self.pool, torch.cuda.graph_pool_handle()
        try:
            captured = self._capture_one(key, inputs)
            sizes = (self._segment_bytes(self.pool, reserved0),
                     kept_bytes(captured.outputs, self.scratch_outputs))
        finally:
            self.pool = shared
        del captured
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return sizes

    def _capture_one(self, key: GraphKey, inputs: dict[str, torch.Tensor]) -> _Captured:
        if not self.use_graphs:  # the last warm-up run stands for the recorded one
            for _ in range(self.warmup_iters - 1):
                self.forward(inputs, key)
            with self.recording():
                self.forward(inputs, key)
            return _Captured(inputs, (), None)
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_iters):
                self.forward(inputs, key)
            graph = _new_graph(self.keep_graphs)
            with self.recording(), capturing(graph, self.pool, side):
                outputs = self.forward(inputs, key)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.keep_graphs and hasattr(graph, "instantiate"):
            graph.instantiate()
        return _Captured(inputs, _release(outputs, self.scratch_outputs), graph)

    def _copy_in(self, key: GraphKey, static: dict[str, torch.Tensor],
                 live: Mapping[str, torch.Tensor]) -> None:
        if live.keys() != static.keys():
            raise ValueError(
                f"inputs for {key}: got names {sorted(live)}, expected {sorted(static)}"
            )
        for name, src in live.items():
            dst = static[name]
            if src.dtype != dst.dtype or src.ndim != dst.ndim or not _copyable(src, dst):
                raise ValueError(
                    f"input {name!r}: got {src.dtype} {tuple(src.shape)} on {src.device}, "
                    f"expected {dst.dtype} {tuple(dst.shape)} on {dst.device} (or pinned host "
                    "memory)"
                )
            if any(s > d for s, d in zip(src.shape, dst.shape, strict=True)):
                raise ValueError(
                    f"input {name!r} of shape {tuple(src.shape)} does not fit the static "
                    f"buffer {tuple(dst.shape)} of {key}"
                )
            if src.shape == dst.shape:
                dst.copy_(src, non_blocking=True)
                continue
            n = src.shape[0]
            dst[tuple(slice(0, s) for s in src.shape)].copy_(src, non_blocking=True)
            pad = self.pad_values.get(name, 0)
            for d in range(1, src.ndim):  # trailing columns the live input lacks
                if src.shape[d] < dst.shape[d]:
                    dst[:n].narrow(d, src.shape[d], dst.shape[d] - src.shape[d]).fill_(
                        0 if pad == "edge" else pad)
            if n < dst.shape[0]:
                if pad == "edge":
                    if n == 0:
                        raise ValueError(f"input {name!r}: 'edge' padding needs at least one row")
                    dst[n:].copy_(dst[n - 1 : n].expand_as(dst[n:]))
                else:
                    dst[n:].fill_(pad)

    def replay(self, key: GraphKey, inputs: Mapping[str, torch.Tensor], out_rows: int) -> Outputs:
        """Run the graph of `key` on live inputs; return outputs[:out_rows].

        Live inputs are copied into the static buffers (rows they do not cover
        get the pad sentinel). A live input is on the buffers' device or, for
        a CUDA graph, in pinned host memory (copied without blocking). On CUDA
        the returned tensors are views of the graph's static outputs: the next
        replay overwrites them (the `scratch_outputs`: the next replay of any key).

        Raises
        ------
        GraphNotCapturedError
            No graph for `key` and on_missing="error".
        ValueError
            Names, dtypes or shapes that do not fit the key's static buffers.
        """
        cap = self._captured.get(key)
        if cap is None:
            if self.on_missing == "error":
                raise GraphNotCapturedError(
                    f"no graph captured for {key}; captured: {len(self._captured)} keys"
                )
            self.num_eager += 1
            return slice_outputs(self.forward(dict(inputs), key), out_rows)
        self._copy_in(key, cap.inputs, inputs)
        return self._run(key, cap, out_rows)

    def _run(self, key: GraphKey, cap: _Captured, out_rows: int) -> Outputs:
        """Replay `cap` (its inputs copied in) and return its first `out_rows` output rows."""
        self.num_replays += 1
        if cap.graph is None:
            return slice_outputs(self.forward(cap.inputs, key), out_rows)
        if self.on_launch is not None:
            self.on_launch()
        cap.graph.replay()
        if cap.sliced is None or cap.sliced[0] != out_rows:  # views of the static outputs
            cap.sliced = (out_rows, slice_outputs(cap.outputs, out_rows))
        return cap.sliced[1]

    def replay_packed(self, key: GraphKey, name: str, src: torch.Tensor, out_rows: int,
                      uploader: Uploader | None = None,
                      current: torch.cuda.Stream | None = None) -> Outputs:
        """`replay` of a key with one input that `src` fills whole (the runner's packed
        buffer: same dtype and shape as the static one, pinned host memory on CUDA), copied
        in by `uploader` when given (the host read off the replay's stream; `current`: the
        current stream, when the caller has it)."""
        cap = self._captured.get(key)
        if cap is None:
            return self.replay(key, {name: src}, out_rows)
        dst = cap.inputs[name]
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"input {name!r}: got {src.dtype} {tuple(src.shape)}, expected "
                             f"{dst.dtype} {tuple(dst.shape)} for {key}")
        if uploader is None:
            dst.copy_(src, non_blocking=True)
        else:
            uploader.copy_(dst, src, current)
        return self._run(key, cap, out_rows)

    def replay_only(self, key: GraphKey) -> None:
        """Replay `key`'s graph with whatever its buffers hold (the benchmark floor)."""
        cap = self._captured[key]
        if cap.graph is None:
            self.forward(cap.inputs, key)
        else:
            cap.graph.replay()
