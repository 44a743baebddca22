"""Piecewise CUDA graphs: the model compiled once, split at the attention ops, each piece
captured per padded token count; attention runs eagerly between the pieces with the live
metadata.

`PiecewiseCompiler` is a torch.compile backend (dynamic shapes, fullgraph): it splits the FX
graph at ``torch.ops.graphattn.write_kv`` / ``rope_write_kv`` / ``paged_attention`` /
``rope_paged_attention`` (consecutive ones form one attention piece), so a model with L
attention layers gives L + 1 pieces around L attention pieces. Each piece is compiled with
inductor on the fake inputs it sees (the default on CUDA; FX submodules elsewhere). On CUDA
each piece is captured into the shared pool once per padded token count (`tokens` set by the
runner for the step), its live activations copied into the captured static inputs before
each replay (weights stay by reference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx.passes.split_module import split_module

from graphattn.backends import ops  # noqa: F401  (registers torch.ops.graphattn)
from graphattn.capture.graphs import capturing
from graphattn.compile import RecompileError, dynamic_shape_config, dynamo_limits
from graphattn.sync import opaque_region

__all__ = ["PiecewiseCompiler", "SPLITTING_OPS"]

SPLITTING_OPS = ("graphattn::paged_attention", "graphattn::write_kv",
                 "graphattn::rope_write_kv", "graphattn::rope_paged_attention",
                 "graphattn::append_paged_attention", "graphattn::cascade_attention")
_SPLIT_TARGETS = frozenset(
    t for name in SPLITTING_OPS
    for op in (getattr(torch.ops.graphattn, name.split("::")[1]),)
    for t in (op, op.default))


def _is_splitting(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _SPLIT_TARGETS


class _Piece:
    """One non-attention piece: one CUDA graph per token count on CUDA, else a plain call.

    `fn` is the piece's FX submodule, or its inductor compilation.
    """

    def __init__(self, fn: Callable[..., Any], owner: PiecewiseCompiler) -> None:
        self.fn, self.owner = fn, owner
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[Any], Any]] = {}

    def __call__(self, *args: Any) -> Any:
        owner = self.owner
        if not owner.use_graphs or owner.tokens is None:
            return self.fn(*args)
        entry = self.graphs.get(owner.tokens)
        if entry is None:
            if not owner.capturing:
                return self.fn(*args)
            # weights and buffers stay by reference; activations get static copies
            static = [a.clone() if isinstance(a, torch.Tensor) and not owner.is_state(a) else a
                      for a in args]
            self.fn(*static)  # warm-up
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, owner.pool, owner.stream):
                out = self.fn(*static)
            entry = self.graphs[owner.tokens] = (graph, static, out)
            owner.num_captured += 1
        graph, static, out = entry
        for dst, src in zip(static, args, strict=True):
            if isinstance(dst, torch.Tensor) and dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        graph.replay()
        return out


class PiecewiseCompiler:
    """Compile `fn` once with dynamic shapes, split at the attention ops.

    Parameters
    ----------
    fn : callable
        The model forward ``fn(inputs, attn_metadata)``.
    device : torch.device or str
        CUDA: pieces are captured per token count into `pool`; else they run eagerly.
    pool : optional
        CUDA graph pool handle shared with the full graphs.
    inner : {"inductor", "eager"}, optional
        How each piece is compiled (default: inductor on CUDA, eager FX elsewhere).

    Attributes
    ----------
    num_pieces, num_attention_pieces : int
        Pieces of the split graph (after the first compile).
    num_compiles : int
    tokens : int or None
        The padded token count of the current step (set with `at_tokens`).
    """

    def __init__(self, fn: Callable[..., Any], device: torch.device | str,
                 pool: Any = None, inner: str | None = None) -> None:
        self.device = torch.device(device)
        self.inner = inner or ("inductor" if self.device.type == "cuda" else "eager")
        if self.inner not in ("inductor", "eager"):
            raise ValueError(f"inner = {inner!r}, expected 'inductor' or 'eager'")
        self.use_graphs = self.device.type == "cuda"
        self.pool = pool
        self.stream = torch.cuda.Stream(self.device) if self.use_graphs else None
        self.tokens: int | None = None
        self.capturing = False
        self.frozen = False
        self.num_compiles = self.num_pieces = self.num_attention_pieces = 0
        self.num_captured = 0
        self._state_ptrs = {t.data_ptr() for t in _module_state(fn)}
        self._compiled = torch.compile(fn, backend=self._backend, dynamic=True, fullgraph=True)

    def is_state(self, t: torch.Tensor) -> bool:
        """A parameter or buffer of the model (the same storage at every call)."""
        return isinstance(t, torch.nn.Parameter) or t.data_ptr() in self._state_ptrs

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        if self.frozen:
            raise RecompileError("piecewise recompile after freeze(): a guarded value changed")
        self.num_compiles += 1
        part = 0
        kinds: dict[int, bool] = {}
        assign: dict[torch.fx.Node, int] = {}
        prev = None
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "call_method" and node.target == "item":
                raise ValueError(f"the compiled forward reads a tensor on the host ({node}): "
                                 "not capturable piecewise")
            split = _is_splitting(node)
            if prev is not None and split != prev:
                part += 1
            assign[node] = part
            kinds[part] = split
            prev = split
        split_gm = split_module(gm, None, lambda n: assign[n], keep_original_order=True)
        self.num_pieces = sum(not v for v in kinds.values())
        self.num_attention_pieces = sum(kinds.values())
        pieces = {name for name, _ in split_gm.named_children()
                  if not kinds.get(int(name.rsplit("_", 1)[1]), False)}
        if self.inner == "inductor":
            compiled = _compile_pieces(split_gm, pieces, example_inputs)
        else:
            compiled = {name: getattr(split_gm, name) for name in pieces}
        for name, fn in compiled.items():
            setattr(split_gm, name, _PieceModule(_Piece(fn, self)))
        return split_gm

    @contextlib.contextmanager
    def at_tokens(self, tokens: int, capture: bool = False) -> Iterator[None]:
        """Run the pieces at `tokens` padded tokens (capturing missing graphs with `capture`)."""
        self.tokens, self.capturing = tokens, capture
        try:
            yield
        finally:
            self.tokens, self.capturing = None, False

    def __call__(self, inputs: dict[str, torch.Tensor], meta: Any) -> Any:
        for t in inputs.values():
            torch._dynamo.maybe_mark_dynamic(t, 0)
        with dynamo_limits(64), opaque_region(), dynamic_shape_config(specialize_int=True):
            return self._compiled(inputs, meta)

    def freeze(self) -> None:
        """From now on a compile raises RecompileError."""
        self.frozen = True


def _compile_pieces(split_gm: torch.fx.GraphModule, pieces: set[str],
                    example_inputs: list[Any]) -> dict[str, Callable[..., Any]]:
    """Inductor-compile each piece on the fake inputs it sees when the split graph runs."""
    from torch._inductor.compile_fx import compile_fx

    compiled: dict[str, Callable[..., Any]] = {}

    class Interp(torch.fx.Interpreter):
        def call_module(self, target: str, args: Any, kwargs: Any) -> Any:
            if target in pieces and target not in compiled:
                sub = getattr(split_gm, target)
                compiled[target] = compile_fx(sub, list(args))
            return super().call_module(target, args, kwargs)

    from torch._subclasses.fake_tensor import FakeTensor

    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise RuntimeError("piecewise inductor compile needs dynamo's fake inputs")
    args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) and not isinstance(
        a, FakeTensor) else a for a in example_inputs]
    with fake_mode:
        Interp(split_gm).run(*args)
    return compiled


def _module_state(fn: Any) -> list[torch.Tensor]:
    """Parameters and buffers of `fn` (an nn.Module, or an object holding one as `model`)."""
    for holder in (fn, getattr(fn, "model", None)):
        if isinstance(holder, torch.nn.Module):
            return [*holder.parameters(), *holder.buffers()]
    return []


class _PieceModule(torch.nn.Module):
    def __init__(self, piece: _Piece) -> None:
        super().__init__()
        self.piece = piece

    def forward(self, *args: Any) -> Any:
        return self.piece(*args)
