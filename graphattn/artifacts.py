"""Compiled functions on disk: dynamo's trace, its guards and inductor's code, saved after a
compile and loaded by the next start instead of tracing again (torch's ahead-of-time compile,
``torch.compile(fn).aot_compile`` / ``torch.compiler.load_compiled_function``).

An `ArtifactStore` is one folder per fingerprint (the compile's settings, the code's
owner types, torch's version): a start with other settings never sees another's files. A
loaded function still checks its guards at every call (shapes, dtypes, constants), and is
dropped at load when the source of any function it traced has changed since it was saved.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["ArtifactStore", "aot_compile_available"]

log = logging.getLogger(__name__)


def aot_compile_available() -> bool:
    """Whether the installed torch saves and loads compiled functions (torch >= 2.10)."""
    return hasattr(torch._dynamo.config, "enable_aot_compile") and hasattr(
        torch.compiler, "load_compiled_function")


def _sources_unchanged(fn: Any) -> bool:
    """Whether every module whose code `fn` traced reads as it did when `fn` was saved."""
    for src in fn.source_info().inlined_sources:
        try:
            now = inspect.getsource(importlib.import_module(src.module))
        except (ImportError, OSError, TypeError):
            return False
        if now != src.content:
            return False
    return True


class ArtifactStore:
    """The compiled functions of one compiler under ``root / name-<fingerprint>``.

    Parameters
    ----------
    root : str or os.PathLike
        Folder of every store (created when first saved to).
    name : str
        What is compiled ("step", "blocks", "assembler").
    fingerprint : str
        Everything besides guards that decides the compiled code (backend options, the
        types whose methods are traced); hashed with torch's version into the folder name.

    Attributes
    ----------
    folder : pathlib.Path
    """

    def __init__(self, root: str | os.PathLike[str], name: str, fingerprint: str) -> None:
        digest = hashlib.sha256(f"{torch.__version__}|{fingerprint}".encode()).hexdigest()
        self.folder = Path(root, f"{name}-{digest[:16]}")

    def load(self) -> Iterator[tuple[str, Callable[..., Any]]]:
        """Each saved function with its tag, oldest first; unreadable or stale files are
        skipped with a warning."""
        for _, path in sorted(self._files()):
            try:
                with open(path, "rb") as f:
                    fn = torch.compiler.load_compiled_function(f)
            except Exception as e:  # another torch, device or Python: compile again
                log.warning("compiled function %s not loaded (%s: %s)", path,
                            type(e).__name__, e)
                continue
            if not _sources_unchanged(fn):
                log.warning("compiled function %s not loaded: the code it traced changed", path)
                continue
            yield path.stem.rpartition("-")[0], fn

    def _files(self) -> list[tuple[int, Path]]:
        """The folder's ``<tag>-<index>.pt2`` files with their index (other files ignored)."""
        if not self.folder.is_dir():
            return []
        found = [(p.stem.rpartition("-")[2], p) for p in self.folder.glob("*-*.pt2")]
        return [(int(i), p) for i, p in found if i.isdigit()]

    def save(self, tag: str, fn: Any) -> bytes | None:
        """Write `fn` (an AOT-compiled function) as the next file of the folder; its bytes,
        or None (with a warning, no file left) where torch cannot save it, e.g. guards on a
        class defined inside a function, as some transformers models' modules are."""
        self.folder.mkdir(parents=True, exist_ok=True)
        index = max((i for i, _ in self._files()), default=-1) + 1
        path = self.folder / f"{tag}-{index}.pt2"
        try:
            data = fn.save_compiled_function(str(path)).serialized_data
        except Exception as e:  # noqa: BLE001 - torch's serializer raises several kinds
            path.unlink(missing_ok=True)
            log.warning("compiled function %s not saved (%s: %s); this start runs it, the "
                        "next compiles it again", path, type(e).__name__, e)
            return None
        log.info("saved compiled function %s", path)
        return data
