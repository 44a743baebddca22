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

from graphattn.sync import opaque_region

__all__ = ["BucketCompiler", "RecompileError", "dynamo_limits"]


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
        False: static shapes per key. True: symbolic batch dims.
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
        self._compiled = torch.compile(fn, backend=self._backend, dynamic=dynamic,
                                       fullgraph=fullgraph)

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
        with dynamo_limits(self.max_compiles), opaque_region():
            try:
                return self._compiled(*args, **kwargs)
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
