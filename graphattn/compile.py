"""torch.compile per graph key, with compile counting and loud steady-state recompiles.

Inductor runs without its own CUDA graphs (which fall off graphs when the
forward mutates a KV cache in place: "skipping cudagraphs due to mutated
inputs"); the compiled forward is then captured by CUDAGraphManager, which
has no such restriction.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx.experimental._config

from graphattn.artifacts import ArtifactStore
from graphattn.sync import opaque_region

log = logging.getLogger(__name__)

__all__ = ["BucketCompiler", "RecompileError", "dynamic_shape_config", "dynamo_limits",
           "mark_static_tensors", "pin_triton_cache", "repeated_blocks", "static_marks"]


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


def pin_triton_cache(device: torch.device) -> str | None:
    """Point Triton's kernel cache (``TRITON_CACHE_DIR``, unless already set) where inductor
    points it when it first builds a kernel of `device`: under its own cache folder.

    Inductor sets the variable only when it builds a kernel in the process, which a start
    that loads every compiled graph from inductor's caches never does; graphattn's Triton
    kernels, compiled after the first compile in a cold start, would then be looked up in
    Triton's default folder in a warm start, miss and compile again (0.2-0.9 s each).
    Set before anything compiles, one folder serves both starts.

    Returns
    -------
    str or None
        The folder in use, None off CUDA (Triton's defaults stand).
    """
    if device.type != "cuda":
        return None
    if "TRITON_CACHE_DIR" not in os.environ:
        from torch._inductor.runtime.runtime_utils import triton_cache_dir

        index = device.index if device.index is not None else torch.cuda.current_device()
        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(index)
        log.info("Triton's kernel cache: %s (inductor's)", os.environ["TRITON_CACHE_DIR"])
    return os.environ["TRITON_CACHE_DIR"]


def dynamic_shape_config(specialize_int: bool) -> contextlib.AbstractContextManager[None]:
    """Dynamo settings of a dynamic-shape compile: Python floats of the metadata stay
    constants (a symbolic float would be a 0-d tensor read back with .item(), a host sync),
    ints too with `specialize_int`; sizes that happen to be equal are not unified (the
    batch and ``max_num_reqs`` at one key: the next key would recompile), and a size of 1
    is not specialized where torch can reason about sizes without it (``backed_size_
    oblivious``): batch 1 shares the compile of the other batch sizes."""
    stack = contextlib.ExitStack()
    cfg = torch._dynamo.config
    names = ("specialize_float", "specialize_int") if specialize_int else ("specialize_float",)
    stack.enter_context(cfg.patch({k: True for k in names if hasattr(cfg, k)}))
    fx_cfg = getattr(torch.fx.experimental, "_config", None)
    shapes = {k: v for k, v in (("use_duck_shape", False), ("backed_size_oblivious", True))
              if hasattr(fx_cfg, k)}
    if shapes:
        stack.enter_context(fx_cfg.patch(shapes))
    return stack


def mark_static_tensors(*roots: object, depth: int = 4) -> list[torch.Tensor]:
    """Mark the tensors held by `roots` static for dynamo (`torch._dynamo.mark_static`).

    A dynamic-shape compile gives every dimension of every input a symbol of its own unless
    marked: the KV caches, the state's buffers and the model's other tensors then add
    symbols by the hundred (four per cache, two caches a layer) whose guards and index
    arithmetic dominate tracing. Walks attributes (``__dict__`` and ``__slots__``), lists,
    tuples and dicts to `depth` levels, and every submodule of an ``nn.Module`` (its
    parameters are static already).

    Returns
    -------
    list of torch.Tensor
        The tensors marked here (those with no dynamo marks of any kind before).
    """
    seen: set[int] = set()
    todo: list[tuple[object, int]] = [(r, 0) for r in roots]
    marked = []
    while todo:
        obj, level = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if not any("dynamo" in k for k in obj.__dict__):  # else marked by its owner
                torch._dynamo.mark_static(obj)
                marked.append(obj)
        elif isinstance(obj, torch.nn.Module):
            for m in obj.modules():
                todo += [(t, level) for t in m._buffers.values()]
                todo += [(v, level + 1) for k, v in vars(m).items() if not k.startswith("_")]
        elif level < depth:
            todo += [(v, level + 1) for v in _children(obj)]
    return marked


@contextlib.contextmanager
def static_marks(*roots: object) -> Iterator[None]:
    """`mark_static_tensors` for the block only: a saved compiled function's guards do not
    record marks, so the tensors it is called with must carry none."""
    marked = mark_static_tensors(*roots)
    try:
        yield
    finally:
        for t in marked:  # the attributes mark_static set (they differ between torch versions)
            for k in [k for k in t.__dict__ if "dynamo" in k]:
                delattr(t, k)


def repeated_blocks(forward: object) -> list[torch.nn.Module]:
    """The blocks a regional compile covers (`CompileConfig.regions` "blocks").

    `forward`'s own ``repeated_blocks`` (a sequence of modules of one class) where it has
    one; else, in `forward` (an ``nn.Module``) or the modules it holds as attributes, the
    ``nn.ModuleList`` of two or more children of one class with the most parameters: a
    decoder's layers.

    Raises
    ------
    ValueError
        None found, or the given blocks are not modules of one class.
    """
    blocks = getattr(forward, "repeated_blocks", None)
    if blocks is None:
        roots = [forward] if isinstance(forward, torch.nn.Module) else [
            v for v in vars(forward).values() if isinstance(v, torch.nn.Module)]
        lists = [m for r in roots for m in r.modules() if isinstance(m, torch.nn.ModuleList)
                 and len(m) > 1 and len({type(b) for b in m}) == 1]
        if not lists:
            raise ValueError(f"CompileConfig(regions='blocks'): {type(forward).__name__} has no "
                             f"ModuleList of two or more blocks of one class and no "
                             f"repeated_blocks attribute")
        blocks = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    blocks = list(blocks)
    if not blocks or not all(isinstance(b, torch.nn.Module) for b in blocks) \
            or len({type(b) for b in blocks}) != 1:
        raise ValueError(f"{type(forward).__name__}.repeated_blocks must be modules of one "
                         f"class, got {sorted({type(b).__name__ for b in blocks})}")
    patched = [type(b).__name__ for b in blocks if "forward" in vars(b)]
    if patched:
        raise ValueError(f"CompileConfig(regions='blocks') compiles the class's forward, but a "
                         f"{patched[0]} block has a forward of its own (an instance attribute)")
    return blocks


def _children(obj: object) -> list[object]:
    """What `obj` holds: items, attribute values, a bound method's object, a closure's
    cells; nothing for scalars, strings, classes and modules."""
    if isinstance(obj, (list, tuple)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, types.MethodType):
        return [obj.__self__]
    if isinstance(obj, types.FunctionType):
        return [_cell(c) for c in obj.__closure__ or ()]
    if isinstance(obj, (str, bytes, int, float, type, types.ModuleType)) or obj is None:
        return []
    out = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        slots = getattr(cls, "__slots__", ())
        slots = (slots,) if isinstance(slots, str) else slots
        out += [getattr(obj, n) for n in slots if hasattr(obj, n)]
    return out


def _cell(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


class _Inductor(torch._TorchCompileInductorWrapper):
    """Inductor as torch.compile's own backend object (whose output dynamo knows how to
    save), with the owner's options of the current size, counting compiles and refusing
    them once frozen."""

    def __init__(self, owner: BucketCompiler) -> None:
        super().__init__(None, None, False)
        self.owner = owner

    # inductor's wrapper compares equal by options, which would let dynamo share cache
    # entries between the static and the shared compile of one function
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any],
                 **kwargs: Any) -> Any:
        self.owner._count()
        with self.owner._inductor_options():
            return super().__call__(gm, example_inputs, **kwargs)


def _recompile_cause(e: BaseException) -> RecompileError | None:
    """The RecompileError that `e` was raised from, if any."""
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, RecompileError):
        cause = cause.__cause__ or cause.__context__
    return cause


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
        shapes, duck sizing off so equal sizes stay apart, sizes of 1 unspecialized where
        torch allows), one compile serving every size but 0; sizes given in `size_options`
        still compile statically under their own options.
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
    static_roots : sequence of objects
        With `dynamic`: the tensors these hold (caches, state buffers: whatever keeps its
        shape from key to key) are marked static while `fn` runs (`static_marks`; once for
        a `calls()` block), so only the per-step tensors and ints get symbols.
    artifacts : ArtifactStore, optional
        Compiled functions are saved there after each compile, and those already there are
        loaded at the first call (under the grad mode of the calls, which guards record): a
        call runs the first whose guards pass before anything is traced (a bound method is
        compiled unbound, its object passed as the first argument).

    Attributes
    ----------
    num_compiles : int
        Graphs compiled so far.
    num_loaded : int
        Compiled functions loaded from `artifacts`.
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
        static_roots: Sequence[object] = (),
        artifacts: ArtifactStore | None = None,
    ) -> None:
        if artifacts is not None and (not fullgraph or backend != "inductor"):
            raise ValueError(f"BucketCompiler(artifacts=...) needs fullgraph=True and backend "
                             f"'inductor', got fullgraph={fullgraph}, backend={backend!r}")
        self.num_compiles = 0
        self._static_roots = tuple(static_roots) if dynamic else ()
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
        self._artifacts = artifacts
        self._loaded: list[tuple[str, Any]] | None = None  # read at the first call
        self._unsaved = False  # torch could not save a compile of this step: compile as usual
        self._in_calls = False
        self.num_loaded = 0
        # saved functions take their object as an argument: it is not pickled with them
        self._bound = fn.__self__ if artifacts is not None and isinstance(
            fn, types.MethodType) else None
        target = fn if self._bound is None else fn.__func__
        aot = {"enable_aot_compile": True} if artifacts is not None else {}
        with torch._dynamo.config.patch(aot):
            self._compiled = self._compile(target, dynamic, fullgraph)
            # a compile of its own: dynamo keeps each backend's graphs apart
            self._static = self._compile(target, False, fullgraph) \
                if dynamic and size_options else None

    def _compile(self, fn: Callable[..., Any], dynamic: bool, fullgraph: bool) -> Any:
        # what torch.compile does, with the backend object innermost: dynamo saves only the
        # code of inductor's own backend object (torch.compile would wrap ours)
        backend = _Inductor(self) if self._inner_name == "inductor" else self._counted
        return torch._dynamo.optimize(backend=backend, nopython=fullgraph, dynamic=dynamic)(fn)

    def _counted(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """A backend other than inductor ("eager", "aot_eager"), compiles counted."""
        self._count()
        return torch._dynamo.lookup_backend(self._inner_name)(gm, example_inputs)

    def _inductor_options(self) -> contextlib.AbstractContextManager[None]:
        return torch._inductor.config.patch(self._size_options.get(self._size, self._options))

    def _count(self) -> None:
        if self.frozen:
            raise RecompileError(
                f"steady-state recompile after {self.num_compiles} compiles: an input shape or "
                "guarded value changed outside the captured keys"
            )
        self.num_compiles += 1

    def _at_static_size(self) -> bool:
        """Whether calls now run the static compile (a `size_options` size under dynamic)."""
        return self._static is not None and self._size in self._size_options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        static = self._at_static_size()
        fn = self._static if static else self._compiled
        with contextlib.nullcontext() if self._in_calls else self._settings(static):
            try:
                if self._artifacts is not None:
                    return self._call_saved(fn, "static" if static else "shared", args, kwargs)
                return fn(*args, **kwargs)
            except Exception as e:
                cause = _recompile_cause(e)
                if cause is not None:
                    raise cause from e
                raise

    def _settings(self, static: bool) -> contextlib.ExitStack:
        """Dynamo's settings for a call: the compile limit, opaque regions, dynamic-shape
        config and static marks."""
        stack = contextlib.ExitStack()
        stack.enter_context(dynamo_limits(self.max_compiles))
        stack.enter_context(opaque_region())
        if self.dynamic and not static:
            # the metadata's ints (row counts) stay symbolic: one compile serves every key
            stack.enter_context(dynamic_shape_config(specialize_int=False))
        # marks only while this compiler runs: other compiles of the same tensors (the
        # piecewise forward) neither see them nor find them changed; a saved function is
        # marked only while it compiles (its guards, rebuilt from the file, record none)
        if self._artifacts is None:
            stack.enter_context(static_marks(*self._static_roots))
        return stack

    @contextlib.contextmanager
    def calls(self) -> Iterator[None]:
        """Block whose calls share one entry of the call settings (`__call__` enters them
        per call otherwise): many calls in a row, such as a step's blocks."""
        if self._in_calls:
            yield
            return
        self._in_calls = True
        try:
            with self._settings(self._at_static_size()):
                yield
        finally:
            self._in_calls = False

    def _call_saved(self, fn: Any, tag: str, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        """Run the first saved or loaded function of `tag` whose guards pass; else compile
        one ahead of time, save it and run it."""
        if self._loaded is None:  # under the caller's grad mode, which the guards record
            self._loaded = list(self._artifacts.load())
            self.num_loaded = len(self._loaded)
        full = args if self._bound is None else (self._bound, *args)
        for have, compiled in self._loaded:
            if have == tag and compiled.guard_check(*full, **kwargs):
                return compiled(*full, **kwargs)
        with static_marks(*self._static_roots):
            if self._unsaved:
                return fn(*full, **kwargs)
            try:
                compiled = fn.aot_compile((full, kwargs))
            except Exception as e:
                if _recompile_cause(e) is not None:
                    raise
                # e.g. guards on a class defined inside a function (some transformers
                # modules'), which torch cannot save: this step compiles as without a folder
                log.warning("compiled step not saved to %s (%s: %s); it compiles at every "
                            "start", self._artifacts.folder, type(e).__name__, e)
                self._unsaved = True
                return fn(*full, **kwargs)
        # run as a later start will: the saved function, its guards rebuilt from the file
        saved = self._artifacts.save(tag, compiled)
        if saved is not None:
            compiled = torch.compiler.load_compiled_function(io.BytesIO(saved))
        self._loaded.append((tag, compiled))
        return compiled(*full, **kwargs)

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
