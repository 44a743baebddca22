"""torch.compile per graph key, with compile counting and loud steady-state recompiles.

Inductor runs without its own CUDA graphs (which fall off graphs when the
forward mutates a KV cache in place: "skipping cudagraphs due to mutated
inputs"); the compiled forward is then captured by CUDAGraphManager, which
has no such restriction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx.experimental._config

from graphattn.sync import opaque_region

__all__ = ["BucketCompiler", "RecompileError", "dynamic_shape_config", "dynamo_limits"]


class RecompileError(RuntimeError):
    """A compile happened after `BucketCompiler.freeze()`."""


def dynamo_limits(limit: int) -> contextlib.AbstractContextManager[None]:
    cfg = torch._dynamo.config
    changes: dict[str, Any] = {}
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            changes[name] = max(limit, getattr(cfg, name))
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        changes["fail_on_recompile_limit_hit"] = True
    return cfg.patch(changes)


def dynamic_shape_config(specialize_int: bool) -> contextlib.AbstractContextManager[None]:
    """Dynamo settings of a dynamic-shape compile: Python floats of the metadata stay
    constants (a symbolic float would be a 0-d tensor read back with .item(), a host sync),
    ints too with `specialize_int`, and sizes that happen to be equal are not unified (the
    batch and ``max_num_reqs`` at one key: the next key would recompile)."""
    stack = contextlib.ExitStack()
    cfg = torch._dynamo.config
    names = ("specialize_float", "specialize_int") if specialize_int else ("specialize_float",)
    stack.enter_context(cfg.patch({k: True for k in names if hasattr(cfg, k)}))
    fx_cfg = getattr(torch.fx.experimental, "_config", None)
    if fx_cfg is not None and hasattr(fx_cfg, "use_duck_shape"):
        stack.enter_context(fx_cfg.patch(use_duck_shape=False))
    return stack


class BucketCompiler:
    """Compile `fn` once per static shape set (one per GraphKey).

    Parameters
    ----------
    fn : callable
        The forward, e.g. ``forward(inputs, key)``. A GraphKey argument is
        guarded on its field values, so each key compiles once.
    backend : str
        Inner dynamo backend ("inductor"; "eager"/"aot_eager" in tests).
    dynamic : bool
        False: static shapes, one compile per shape. True: symbolic sizes (dynamo's dynamic
        shapes, duck sizing off so equal sizes stay apart), one compile serving every size
        but those dynamo specializes (0 and 1); sizes given in `size_options` still compile
        statically under their own options.
    max_compiles : int
        Dynamo's recompile limit is raised to this, and hitting it fails
        instead of silently running eager.
    fullgraph : bool
        Refuse graph breaks (the whole function must compile to one graph).
    options : dict, optional
        Inductor options; "triton.cudagraphs" is forced off.
    size_options : mapping of int to dict, optional
        Inductor options (in full) of the compiles that run inside ``at_size(n)`` for these
        n, in place of `options`.

    Attributes
    ----------
    num_compiles : int
        Graphs compiled so far.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        backend: str = "inductor",
        dynamic: bool = False,
        max_compiles: int = 256,
        options: dict[str, Any] | None = None,
        fullgraph: bool = True,
        size_options: Mapping[int, dict[str, Any]] | None = None,
    ) -> None:
        self.num_compiles = 0
        self.frozen = False
        self.max_compiles = max_compiles
        self._inner_name = backend
        self._options = dict(options or {})
        self._size_options = {n: dict(o) for n, o in (size_options or {}).items()}
        self._size: int | None = None
        if backend == "inductor":
            for opts in (self._options, *self._size_options.values()):
                opts["triton.cudagraphs"] = False
        self.dynamic = dynamic
        self._compiled = torch.compile(fn, backend=self._backend, dynamic=dynamic,
                                       fullgraph=fullgraph)
        # a torch.compile of its own: dynamo keeps each backend's graphs apart
        self._static = torch.compile(fn, backend=self._backend, dynamic=False,
                                     fullgraph=fullgraph) if dynamic and size_options else None

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if self.frozen:
            raise RecompileError(
                f"steady-state recompile after {self.num_compiles} compiles: an input shape or "
                "guarded value changed outside the captured keys"
            )
        self.num_compiles += 1
        if self._inner_name == "inductor":
            from torch._inductor.compile_fx import compile_fx

            with torch._inductor.config.patch(self._size_options.get(self._size,
                                                                     self._options)):
                return compile_fx(gm, example_inputs)
        return torch._dynamo.lookup_backend(self._inner_name)(gm, example_inputs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        static = self._static is not None and self._size in self._size_options
        fn = self._static if static else self._compiled
        # the metadata's ints (row counts) stay symbolic: one compile serves every key
        shapes = dynamic_shape_config(specialize_int=False) if self.dynamic and not static \
            else contextlib.nullcontext()
        with dynamo_limits(self.max_compiles), opaque_region(), shapes:
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                cause = e
                while cause is not None and not isinstance(cause, RecompileError):
                    cause = cause.__cause__ or cause.__context__
                if cause is not None:
                    raise cause from e
                raise

    @contextlib.contextmanager
    def at_size(self, num_tokens: int) -> Iterator[None]:
        """Block whose compiles take ``size_options[num_tokens]`` where given."""
        before, self._size = self._size, num_tokens
        try:
            yield
        finally:
            self._size = before

    def freeze(self) -> None:
        """From now on any compile raises RecompileError."""
        self.frozen = True

    @contextlib.contextmanager
    def steady_state(self) -> Iterator[None]:
        """Block in which compiles raise RecompileError."""
        before, self.frozen = self.frozen, True
        try:
            yield
        finally:
            self.frozen = before
