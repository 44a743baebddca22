"""The backend contract (typed protocols) and the registry of backends by name.

A backend is a builder (plans metadata from CPU numbers, capturable device
work only), an impl (runs attention from that metadata) and a metadata class
that names its device tensors and their pad values. Register one with
``register_backend("name", BackendSpec(...))``, from any module: the runner
and the capture layer only ever see this contract.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import torch

from graphattn.buckets import LengthBuckets
from graphattn.keys import CaptureSupport, GraphKey

if TYPE_CHECKING:
    from graphattn.metadata import CommonAttentionMetadata

__all__ = ["AttentionBuilder", "AttentionImpl", "BackendMetadata", "BackendSpec",
           "BuilderContext", "PadValue", "backend_names", "get_backend", "register_backend",
           "resolve_builder"]

PadValue = int | float | Literal["edge"]


class BackendMetadata:
    """Mixin for backend metadata dataclasses: their device tensors as a dict.

    `tensor_fields` names the fields a captured graph reads; they become the
    graph's static inputs, and `with_tensors` rebinds them to static buffers.
    `pad_values` gives the sentinel a static buffer's uncovered rows get
    (default 0; -1 for slot mappings, "edge" to repeat the last row).
    """

    __slots__ = ()
    tensor_fields: ClassVar[tuple[str, ...]] = ()
    pad_values: ClassVar[dict[str, PadValue]] = {}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in self.tensor_fields}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> Any:
        return dataclasses.replace(self, **{f: tensors[f] for f in self.tensor_fields})


@runtime_checkable
class AttentionBuilder(Protocol):
    """Plans a backend's metadata.

    ``build(common, key)`` reads CPU numbers only to decide shapes; with a
    `key` the plan is the key's (so one captured graph serves every batch of
    the key) and the device work it does must be capturable.
    """

    def build(self, common: CommonAttentionMetadata, key: GraphKey | None = None) -> Any: ...


@runtime_checkable
class AttentionImpl(Protocol):
    """Runs attention: ``forward(*inputs, kv_cache, meta)`` with fixed shapes for a plan."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class BuilderContext:
    """What a builder factory is given by the runner.

    Attributes
    ----------
    block_size : int
        KV-cache block size.
    decode_query_len : int
        1 + speculative tokens per decode row.
    max_model_len : int
    length_buckets : LengthBuckets
    device : torch.device
    """

    block_size: int
    decode_query_len: int
    max_model_len: int
    length_buckets: LengthBuckets
    device: torch.device


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A registered backend.

    Attributes
    ----------
    make_builder : callable
        ``make_builder(ctx: BuilderContext) -> AttentionBuilder``.
    impl_cls : type
        The AttentionImpl.
    metadata_cls : type
        The BackendMetadata subclass its builder returns (tensor fields, pad values).
    capture_support : CaptureSupport
        Which batches may run inside a captured graph.
    """

    make_builder: Callable[[BuilderContext], AttentionBuilder]
    impl_cls: type
    metadata_cls: type[BackendMetadata]
    capture_support: CaptureSupport


_REGISTRY: dict[str, BackendSpec] = {}


def resolve_builder(spec: BackendSpec, ctx: BuilderContext,
                    given: object | None = None) -> AttentionBuilder:
    """`given` (TypeError unless it has ``build(common, key)``), else the spec's builder."""
    builder = spec.make_builder(ctx) if given is None else given
    if not isinstance(builder, AttentionBuilder):
        raise TypeError(f"builder {type(builder).__name__} has no build(common, key)")
    return builder


def register_backend(name: str, spec: BackendSpec) -> None:
    """Register (or replace) a backend under `name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend name must be a non-empty str, got {name!r}")
    if not isinstance(spec, BackendSpec):
        raise TypeError(f"spec must be a BackendSpec, got {type(spec).__name__}")
    _REGISTRY[name] = spec


def backend_names() -> list[str]:
    """Names of the registered backends, built-in ones included."""
    import graphattn.backends  # noqa: F401  (registers the built-in backends)

    return sorted(_REGISTRY)


def get_backend(name: str) -> BackendSpec:
    """Spec of the backend registered as `name`."""
    names = backend_names()
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}, expected one of {names}")
    return _REGISTRY[name]
