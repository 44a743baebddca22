"""The runner's configuration: one validated, frozen object (`RunnerConfig`).

Field names follow vLLM's ``CompilationConfig`` where one exists (`cudagraph_mode`); which
graphs exist is a `BucketPolicy`; how the device step is compiled is a `CompileConfig`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from graphattn.buckets import BucketPolicy
from graphattn.checks import as_index
from graphattn.keys import CUDAGraphMode

__all__ = ["INPUT_NAMES", "CompileConfig", "RunnerConfig"]

# what a forward may ask for in its `inputs` (GraphRunner passes these by name); a forward
# that reads "logits_indices" returns logits at those token rows only
INPUT_NAMES = ("input_ids", "positions", "req_slots", "logits_indices")
ON_MISSING = ("eager", "error")
REGIONS = ("step", "blocks")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


def inductor_has_pdl() -> bool:
    """Whether the installed torch's inductor can launch its Triton kernels with
    programmatic dependent launch (``torch._inductor.config.triton.enable_pdl``)."""
    from torch._inductor import config

    return hasattr(config.triton, "enable_pdl")


@dataclass(frozen=True, slots=True)
class CompileConfig:
    """How the runner compiles its device step (`graphattn.compile.BucketCompiler`).

    Parameters
    ----------
    enabled : bool
        Compile the device step: prepare's device half, then the forward with sampling /
        verification, write-back and the truth's advance, one compile per batch shape
        serving every length bucket. Attention and the KV write stay opaque custom ops.
    backend : str
        Dynamo backend: "inductor", or "eager" / "aot_eager" (tests, debugging).
    mode : str, optional
        Inductor mode ("default", "max-autotune-no-cudagraphs", ...); inductor's own CUDA
        graphs are always off (the runner captures the compiled code itself).
    options : mapping, optional
        Inductor options (``torch._inductor.config`` names).
    fullgraph : bool
        Refuse graph breaks in the compiled step.
    max_compiles : int
        Dynamo's recompile limit is raised to this; hitting it fails loudly.
    pdl : bool
        Inductor's Triton kernels launched with programmatic dependent launch
        (``triton.enable_pdl``): each waits for its inputs inside the kernel, so its launch
        and prologue overlap the previous kernel's tail (compute capability >= 9; inductor
        emits plain launches elsewhere). ValueError when built if the installed torch's
        inductor lacks the option.
    compile_threads : int, optional
        Inductor's compile workers while the runner compiles (``compile_threads``). None:
        inductor's default, a worker pool (pays on a cold cache, where kernels compile); 1:
        every kernel compiles in this process and no pool starts, the fast path when
        inductor's cache (``TORCHINDUCTOR_CACHE_DIR``) already holds the kernels: a warm
        start then skips the pool's start-up (`bench.warm_start --warm-compile-threads 1`).
    dynamic : bool
        One compile for every batch shape: the token and request counts are symbolic
        (dynamo's dynamic shapes), and each key's graph is captured from the shared code.
        Batch 1 shares the decode compile (sizes of 1 are not specialized where the
        installed torch has ``backed_size_oblivious``; list it in `size_options` to compile
        it on its own), and so do the mixed keys (the attention op picks its decode or
        mixed path from the plan's ints when it runs), so a 256-request policy of 37 keys
        compiles 1 step graph instead of 37: the cold-start path. False: one compile per
        batch shape, each specialized to its sizes.
    size_options : mapping of int to str or mapping, optional
        Per padded token count (a key's ``num_tokens_padded``: its batch shape), an inductor
        mode name or options that its compile adds to `mode` and `options`, e.g.
        ``{1: "max-autotune-no-cudagraphs"}`` autotunes the batch-1 decode alone, where
        it may pay, and leaves every other shape's compile time as it is. With `dynamic`,
        these shapes compile statically, apart from the shared code.
    artifact_dir : str or os.PathLike, optional
        Folder of compiled step functions (`graphattn.artifacts.ArtifactStore`; with regions
        "blocks", the layers' shared function): each compile is saved there, dynamo's trace
        and guards with inductor's code, and a later runner with the same settings loads
        them instead of tracing again (the warm start). A loaded function still checks its
        guards at each call and is dropped when the code it traced has changed. Needs
        backend "inductor", `fullgraph` and a torch that saves compiled functions
        (`graphattn.artifacts.aot_compile_available`); ValueError when built otherwise.
        Inductor's kernels are cached apart, in ``TORCHINDUCTOR_CACHE_DIR``; on CUDA,
        graphattn's Triton kernels beside them (`graphattn.compile.pin_triton_cache`).
    regions : str
        What one compile covers. "step": the whole device step, one graph (the default;
        fusions across the step). "blocks": the forward's repeated blocks
        (`graphattn.compile.repeated_blocks`: its decoder layers), one compile shared by
        every block (dynamo inlines a block's parameters as inputs), while the rest of the
        step (embedding, head, sampling, metadata) runs uncompiled; the captured graph
        holds it all either way, so a replay pays no Python, and compile time no longer
        grows with the number of layers: the cold-start path for deep models. With
        `artifact_dir`, the shared block function is what is saved and loaded.
    """

    enabled: bool = False
    backend: str = "inductor"
    mode: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    fullgraph: bool = True
    max_compiles: int = 256
    pdl: bool = False
    compile_threads: int | None = None
    dynamic: bool = False
    size_options: Mapping[int, str | Mapping[str, Any]] = field(default_factory=dict)
    artifact_dir: str | os.PathLike[str] | None = None
    regions: str = "step"

    def __post_init__(self) -> None:
        _check_bool("CompileConfig.enabled", self.enabled)
        _check_bool("CompileConfig.pdl", self.pdl)
        if self.pdl and not inductor_has_pdl():
            raise ValueError(f"CompileConfig.pdl = True needs inductor's triton.enable_pdl, "
                             f"which torch {torch.__version__} lacks")
        _check_bool("CompileConfig.fullgraph", self.fullgraph)
        _check_bool("CompileConfig.dynamic", self.dynamic)
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"CompileConfig.backend must be a backend name, got "
                             f"{self.backend!r}")
        if self.mode is not None and (self.backend != "inductor"
                                      or not isinstance(self.mode, str)):
            raise ValueError(f"CompileConfig.mode = {self.mode!r} needs backend 'inductor' "
                             f"(got {self.backend!r}) and a mode name")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"CompileConfig.options must be a mapping, got "
                             f"{type(self.options).__name__}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        as_index("CompileConfig.max_compiles", self.max_compiles, 1)
        if self.compile_threads is not None:
            as_index("CompileConfig.compile_threads", self.compile_threads, 1)
        self._check_size_options()
        self._check_artifact_dir()
        if self.regions not in REGIONS:
            raise ValueError(f"CompileConfig.regions must be one of {REGIONS}, got "
                             f"{self.regions!r}")

    def _check_artifact_dir(self) -> None:
        if self.artifact_dir is None:
            return
        if not isinstance(self.artifact_dir, str | os.PathLike):
            raise ValueError(f"CompileConfig.artifact_dir must be a folder path, got "
                             f"{type(self.artifact_dir).__name__}")
        if self.backend != "inductor" or not self.fullgraph:
            raise ValueError(f"CompileConfig.artifact_dir needs backend 'inductor' and "
                             f"fullgraph=True, got backend {self.backend!r}, fullgraph "
                             f"{self.fullgraph}")
        from graphattn.artifacts import aot_compile_available

        if not aot_compile_available():
            raise ValueError(f"CompileConfig.artifact_dir needs torch's saved compiled "
                             f"functions (torch.compiler.load_compiled_function), which "
                             f"torch {torch.__version__} lacks")

    def _check_size_options(self) -> None:
        if not isinstance(self.size_options, Mapping):
            raise ValueError(f"CompileConfig.size_options must be a mapping, got "
                             f"{type(self.size_options).__name__}")
        if self.size_options and self.backend != "inductor":
            raise ValueError(f"CompileConfig.size_options needs backend 'inductor', got "
                             f"{self.backend!r}")
        for size, opts in self.size_options.items():
            as_index("CompileConfig.size_options key", size, 1)
            if not isinstance(opts, str | Mapping):
                raise ValueError(f"CompileConfig.size_options[{size}] must be an inductor mode "
                                 f"name or a mapping of options, got {type(opts).__name__}")
            if isinstance(opts, str):
                from torch._inductor import list_mode_options

                try:
                    list_mode_options(opts)
                except (KeyError, ValueError, RuntimeError) as e:
                    raise ValueError(f"CompileConfig.size_options[{size}] = {opts!r} is not an "
                                     f"inductor mode") from e
        object.__setattr__(self, "size_options", MappingProxyType(dict(self.size_options)))

    def inductor_options(self, num_tokens: int | None = None) -> dict[str, Any]:
        """The inductor options of `mode` and `options` (`options` win), then those of
        ``size_options[num_tokens]`` where given; CUDA graphs off."""
        from torch._inductor import list_mode_options

        opts: dict[str, Any] = {}
        if self.mode is not None:
            opts.update(list_mode_options(self.mode))
        if self.pdl:
            opts["triton.enable_pdl"] = True
        if self.compile_threads is not None:
            opts["compile_threads"] = self.compile_threads
        opts.update(self.options)
        extra = self.size_options.get(num_tokens, {})
        opts.update(list_mode_options(extra) if isinstance(extra, str) else extra)
        opts["triton.cudagraphs"] = False
        return opts


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """Everything that configures a `GraphRunner`, validated on construction.

    Parameters
    ----------
    backend : str, optional
        Registered attention backend (`graphattn.backends.backend_names()`): its builder is
        the runner's default and its capture support is what the dispatcher honours.
        Default: the first of the forward's ``backends`` (e.g. "mla" for a DeepSeek model
        through `HFCausalLM`), else "paged".
    cudagraph_mode : CUDAGraphMode or str
        Which graphs exist: full keys, piecewise keys (the forward compiled once and split
        at the attention ops, needs ``policy.piecewise_token_sizes``), both (default: full
        first, then piecewise, then eager), full for uniform decode only, or none.
    policy : BucketPolicy
        Capture sizes, length boundaries, mixed and piecewise token sizes and
        ``decode_query_len`` (1 + drafts per decode row).
    compile : CompileConfig or bool
        ``True`` is ``CompileConfig(enabled=True)``.
    sampling : bool
        Sample on the device with each request's `SamplingParams` (temperature, top-k,
        top-p, seed) and return logprobs; False: greedy only (no sort in the graph).
    overlap_copies : bool
        On CUDA, each replayed step's packed input goes to the device and its tokens to the
        host on side streams behind device copies: the host memory's latency overlaps the
        previous graph. False keeps the copies on the current stream (less host work per
        step, for host-bound loops).
    on_missing : {"eager", "error"}
        A key without a graph runs eagerly at the key's padded shapes, or raises
        `GraphNotCapturedError` (also for a batch no key fits).
    static_input_names : tuple of str, optional
        Subset of ("input_ids", "positions", "req_slots", "logits_indices") the forward
        reads from `inputs`; default: the forward's own ``static_input_names``, else the
        first two. A forward that reads "logits_indices" (int64 [rows]) returns logits at
        those token rows only, [rows, vocab]; any other returns [num_tokens, vocab].
    vocab_size : int, optional
        Prompt and draft ids are checked against it (default: the model's
        ``cfg.vocab_size`` / ``config.vocab_size``).
    lazy_capture : bool
        Capture a full key the first time a step needs it instead of all at `capture()`:
        that step runs eagerly at the key's padded shapes (compiling it, when compiled), then
        the key is captured before step() returns (logged, and kept in
        ``GraphRunner.lazy_report``). That first step and capture may sync (once per key,
        allowed inside no_host_sync()). Needs on_missing="eager".
    graph_memory_limit : int, optional
        Bytes of graph pool after which no new key is captured (by `capture()` or lazily):
        those keys run eagerly at their padded shapes and are listed in the report's
        ``over_budget``. Default: no limit.
    """

    backend: str | None = None
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE
    policy: BucketPolicy = field(default_factory=BucketPolicy)
    compile: CompileConfig = field(default_factory=CompileConfig)
    sampling: bool = False
    overlap_copies: bool = True
    on_missing: str = "eager"
    static_input_names: tuple[str, ...] | None = None
    vocab_size: int | None = None
    lazy_capture: bool = False
    graph_memory_limit: int | None = None

    def __post_init__(self) -> None:
        if self.backend is not None and not isinstance(self.backend, str):
            raise ValueError(f"RunnerConfig.backend must be a backend name, got "
                             f"{self.backend!r}")
        try:
            object.__setattr__(self, "cudagraph_mode", CUDAGraphMode(self.cudagraph_mode))
        except ValueError:
            raise ValueError(f"RunnerConfig.cudagraph_mode = {self.cudagraph_mode!r}, expected "
                             f"one of {[m.value for m in CUDAGraphMode]}") from None
        if not isinstance(self.policy, BucketPolicy):
            raise ValueError(f"RunnerConfig.policy must be a BucketPolicy, got "
                             f"{type(self.policy).__name__}")
        if isinstance(self.compile, bool):
            object.__setattr__(self, "compile", CompileConfig(enabled=self.compile))
        if not isinstance(self.compile, CompileConfig):
            raise ValueError(f"RunnerConfig.compile must be a CompileConfig or a bool, got "
                             f"{type(self.compile).__name__}")
        _check_bool("RunnerConfig.sampling", self.sampling)
        _check_bool("RunnerConfig.overlap_copies", self.overlap_copies)
        if self.on_missing not in ON_MISSING:
            raise ValueError(f"RunnerConfig.on_missing = {self.on_missing!r}, expected one of "
                             f"{ON_MISSING}")
        if self.static_input_names is not None:
            names = self.static_input_names
            if isinstance(names, str) or not all(isinstance(n, str) for n in names) or (
                    set(names) - set(INPUT_NAMES)):
                raise ValueError(f"RunnerConfig.static_input_names = {names!r}, expected a "
                                 f"subset of {INPUT_NAMES}")
            object.__setattr__(self, "static_input_names", tuple(names))
        if self.vocab_size is not None:
            as_index("RunnerConfig.vocab_size", self.vocab_size, 1)
        _check_bool("RunnerConfig.lazy_capture", self.lazy_capture)
        if self.lazy_capture and self.on_missing != "eager":
            raise ValueError("RunnerConfig.lazy_capture needs on_missing = 'eager' (the step "
                             f"that meets a new key runs eagerly), got {self.on_missing!r}")
        if self.graph_memory_limit is not None:
            as_index("RunnerConfig.graph_memory_limit", self.graph_memory_limit, 0)
