"""Argument checks shared by every stage: each error names the parameter, the expected and
the actual value, and runs before anything changes."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["INT32_MAX", "as_index", "as_int32_array", "is_integer_tensor"]

INT32_MAX = int(np.iinfo(np.int32).max)


def as_index(name: str, value: object, lo: int = 0, hi: int | None = None) -> int:
    """`value` as a Python int in [lo, hi]; floats (5.5, and 5.0 too), bools and strings are
    refused rather than truncated."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} = {v}, expected {rng}")
    return v


def as_int32_array(name: str, value: np.ndarray | Sequence[int], lo: int = -INT32_MAX - 1,
                   hi: int = INT32_MAX) -> np.ndarray:
    """A fresh 1-D int32 copy of `value`, range-checked in its own dtype before the cast.

    Raises
    ------
    ValueError
        Not 1-D, not integers, or an entry outside [lo, hi] (named by index and value).
    """
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size:
        info = np.iinfo(arr.dtype)  # a bound the dtype cannot pass costs no reduction
        if (lo > info.min and arr.min() < lo) or (hi < info.max and arr.max() > hi):
            i = int(np.argmax((arr < lo) | (arr > hi)))
            rng = f">= {lo}" if hi == INT32_MAX else f"in [{lo}, {hi}]"
            raise ValueError(f"{name}[{i}] = {arr[i]}, expected {rng}")
    return np.array(arr, dtype=np.int32, copy=True)


def is_integer_tensor(value: object) -> bool:
    """A tensor of integer ids: not floating, complex or bool."""
    return isinstance(value, torch.Tensor) and not (
        value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
