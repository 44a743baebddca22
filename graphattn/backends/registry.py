"""Backend names -> builder + impl, with the capture support the dispatcher honours."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from capture.dispatcher import CaptureSupport

__all__ = ["AttentionBackendEnum", "BackendMetadata", "BackendSpec", "get_backend",
           "register_backend"]


class AttentionBackendEnum(str, enum.Enum):
    PAGED = "paged"
    CROSS = "cross"
    MLA = "mla"
    FLEX = "flex"
    SPARSE_INDEXER = "sparse_indexer"


class BackendMetadata:
    """Mixin for backend metadata dataclasses: their device tensors as a dict.

    `tensor_fields` names the fields a captured graph reads; they become the
    graph's static inputs, and `with_tensors` rebinds them to static buffers.
    """

    __slots__ = ()
    tensor_fields: ClassVar[tuple[str, ...]] = ()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in self.tensor_fields}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> Any:
        return dataclasses.replace(self, **{f: tensors[f] for f in self.tensor_fields})


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """A registered backend.

    Attributes
    ----------
    builder_cls : type
        Plans metadata from CommonAttentionMetadata (CPU numbers only).
    impl_cls : type
        Runs attention from that metadata (capturable).
    capture_support : CaptureSupport
    """

    builder_cls: type
    impl_cls: type
    capture_support: CaptureSupport


_REGISTRY: dict[AttentionBackendEnum, BackendSpec] = {}


def register_backend(name: AttentionBackendEnum, spec: BackendSpec) -> None:
    """Register (or replace) a backend."""
    _REGISTRY[AttentionBackendEnum(name)] = spec


def get_backend(name: AttentionBackendEnum | str) -> BackendSpec:
    """Spec of a backend by enum or string name."""
    import graphattn.backends  # noqa: F401  (registers the built-in backends)

    try:
        key = AttentionBackendEnum(name)
    except ValueError:
        raise ValueError(
            f"unknown backend {name!r}, expected one of {[e.value for e in AttentionBackendEnum]}"
        ) from None
    if key not in _REGISTRY:
        raise ValueError(f"backend {key.value!r} is not registered")
    return _REGISTRY[key]
