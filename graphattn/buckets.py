"""Capture sizes, length buckets and padding accounting."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from graphattn.checks import as_index

__all__ = [
    "BucketPolicy",
    "LengthBuckets",
    "PaddingStats",
    "default_capture_sizes",
    "pad_to_capture_size",
    "validate_sizes",
]


MAX_SIZE = 1 << 20  # padded requests or tokens of one graph


def validate_sizes(name: str, sizes: Sequence[int]) -> tuple[int, ...]:
    """Return `sizes` as a tuple after checking it is sorted, unique, integral and in
    [1, MAX_SIZE] (a larger size would allocate static buffers of that many rows)."""
    out = tuple(as_index(f"{name}[{i}]", s, 1, MAX_SIZE) for i, s in enumerate(sizes))
    if not out:
        raise ValueError(f"{name} must not be empty")
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise ValueError(f"{name} must be sorted and unique, got {list(out)}")
    return out


def default_capture_sizes(max_size: int = 512) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_size` (itself included)."""
    as_index("max_size", max_size, 1, MAX_SIZE)
    sizes = [s for s in (1, 2, 4) if s < max_size] + list(range(8, max_size + 1, 8))
    if sizes[-1:] != [max_size]:
        sizes.append(max_size)
    return tuple(sorted(set(sizes)))


def pad_to_capture_size(n: int, capture_sizes: Sequence[int]) -> int | None:
    """Smallest capture size >= n, or None when n exceeds all (run eager).

    `capture_sizes` must be sorted ascending. n = 0 (an empty batch) pads to
    the smallest size, so the dummy run replays a graph too.
    """
    n = as_index("n", n)
    _check_sorted(tuple(capture_sizes))
    i = bisect.bisect_left(capture_sizes, n)
    return None if i == len(capture_sizes) else int(capture_sizes[i])


@functools.lru_cache(maxsize=64)
def _check_sorted(sizes: tuple[int, ...]) -> None:
    if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
        raise ValueError(f"capture_sizes must be sorted ascending and unique, got {list(sizes)}")


@dataclass(frozen=True, slots=True)
class LengthBuckets:
    """Buckets of upper-bound max lengths: powers of two, or a given list.

    Parameters
    ----------
    max_model_len : int
        The last bucket; longer lengths are an error.
    boundaries : sequence of int, optional
        Sorted, unique bucket tops; `max_model_len` is appended when missing
        and larger ones are dropped. Default: 16, 32, 64, ... capped there.
    """

    max_model_len: int
    boundaries: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        as_index("max_model_len", self.max_model_len, 1)
        if self.boundaries:
            b = [x for x in validate_sizes("boundaries", self.boundaries) if x < self.max_model_len]
        else:
            b = [1 << k for k in range(4, self.max_model_len.bit_length())]
            b = [x for x in b if x < self.max_model_len]
        object.__setattr__(self, "boundaries", tuple(b) + (self.max_model_len,))

    def bucket(self, max_len: int) -> int:
        """Smallest bucket >= max_len (0 goes to the first bucket)."""
        if not 0 <= max_len <= self.max_model_len:
            raise ValueError(f"max_len = {max_len}, expected in [0, {self.max_model_len}]")
        return self.boundaries[bisect.bisect_left(self.boundaries, max_len)]

    def buckets_of(self, lengths: np.ndarray) -> np.ndarray:
        """Vectorized `bucket` for an int array."""
        lengths = np.asarray(lengths)
        if lengths.size and (lengths.min() < 0 or lengths.max() > self.max_model_len):
            raise ValueError(
                f"lengths must be in [0, {self.max_model_len}], got min {lengths.min()} "
                f"max {lengths.max()}"
            )
        idx = np.searchsorted(np.asarray(self.boundaries), lengths, side="left")
        return np.asarray(self.boundaries)[idx]


@dataclass(slots=True)
class PaddingStats:
    """Running count of real against padded work.

    Attributes
    ----------
    real_tokens, padded_tokens, real_reqs, padded_reqs : int
        Totals over the recorded steps (padded = what ran, padding included).
    real_len, padded_len : int
        Sum of true max length and of its bucket.
    """

    real_tokens: int = 0
    padded_tokens: int = 0
    real_reqs: int = 0
    padded_reqs: int = 0
    real_len: int = 0
    padded_len: int = 0
    steps: int = 0

    def record(self, num_reqs: int, num_reqs_padded: int, num_tokens: int,
               num_tokens_padded: int, max_len: int = 0, max_len_bucket: int = 0) -> None:
        if num_reqs_padded < num_reqs or num_tokens_padded < num_tokens:
            raise ValueError(
                f"padded sizes ({num_reqs_padded}, {num_tokens_padded}) below real "
                f"({num_reqs}, {num_tokens})"
            )
        self.real_reqs += num_reqs
        self.padded_reqs += num_reqs_padded
        self.real_tokens += num_tokens
        self.padded_tokens += num_tokens_padded
        self.real_len += max_len
        self.padded_len += max(max_len_bucket, max_len)
        self.steps += 1

    @property
    def token_waste(self) -> float:
        """Fraction of run tokens that were padding."""
        return 0.0 if not self.padded_tokens else 1 - self.real_tokens / self.padded_tokens

    @property
    def length_waste(self) -> float:
        """Fraction of the bucketed lengths beyond the bound."""
        return 0.0 if not self.padded_len else 1 - self.real_len / self.padded_len


@dataclass(frozen=True, slots=True)
class BucketPolicy:
    """Which graphs exist.

    Parameters
    ----------
    capture_sizes : tuple[int, ...]
        Padded request counts of uniform-decode graphs.
    length_boundaries : tuple[int, ...]
        Length buckets (default powers of two up to max_model_len).
    mixed_token_sizes : tuple[int, ...]
        Padded token counts of mixed prefill+decode graphs (empty: eager).
    decode_query_len : int
        1 + speculative tokens per decode row.
    piecewise_token_sizes : tuple[int, ...]
        Padded token counts at which the pieces of a piecewise-compiled model are
        captured (empty: no piecewise mode).
    shared_prefix_sizes : tuple[int, ...]
        Shared-prefix lengths (tokens, multiples of the block size) of uniform-decode keys
        with shared-prefix attention (`graphattn.cascade`): each decode key is also
        captured once per size below its length bucket (empty: off).
    """

    capture_sizes: tuple[int, ...] = field(default_factory=lambda: default_capture_sizes(16))
    length_boundaries: tuple[int, ...] = ()
    mixed_token_sizes: tuple[int, ...] = ()
    decode_query_len: int = 1
    piecewise_token_sizes: tuple[int, ...] = ()
    shared_prefix_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.shared_prefix_sizes:
            validate_sizes("shared_prefix_sizes", self.shared_prefix_sizes)
        validate_sizes("capture_sizes", self.capture_sizes)
        if self.mixed_token_sizes:
            validate_sizes("mixed_token_sizes", self.mixed_token_sizes)
        if self.piecewise_token_sizes:
            validate_sizes("piecewise_token_sizes", self.piecewise_token_sizes)
        as_index("decode_query_len", self.decode_query_len, 1, 1 << 10)
