"""Graph keys, capture support and the batch shape that picks a key (CPU numbers only).

The lowest layer of the graph machinery: backends and the capture layer both
import it, and it imports nothing from either.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

__all__ = ["BatchShape", "CUDAGraphMode", "CaptureSupport", "GraphKey", "capture_order"]


class CUDAGraphMode(str, enum.Enum):
    """How steps use CUDA graphs.

    none: every step eager. piecewise: the model compiled once and split at the
    attention ops, each piece captured per padded token count, attention eager
    between them. full: whole steps captured per key (uniform decode and mixed
    keys). full_decode_only: whole steps for uniform decode only.
    full_and_piecewise: full keys first, piecewise for batches no full key fits.
    """

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @property
    def has_full(self) -> bool:
        return self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY,
                        CUDAGraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)


class CaptureSupport(enum.IntEnum):
    """Which batches a backend lets run inside a captured graph."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass(frozen=True, slots=True, order=True)
class GraphKey:
    """The shape a captured graph was recorded for.

    Attributes
    ----------
    num_reqs_padded : int
        Rows (padded rows carry query length 0, seq len 0).
    num_tokens_padded : int
    max_len_bucket : int
        Bucket of the upper-bound max length; sizes length-dependent buffers.
    uniform_decode : bool
        Every row has the same query length num_tokens_padded / num_reqs_padded.
    shared_prefix : int
        Tokens of a prefix that a group of rows shares (read once per KV head for the
        group: shared-prefix, or cascade, attention); 0: off.
    """

    num_reqs_padded: int
    num_tokens_padded: int
    max_len_bucket: int
    uniform_decode: bool
    shared_prefix: int = 0

    def __post_init__(self) -> None:
        if self.num_reqs_padded < 1 or self.num_tokens_padded < self.num_reqs_padded:
            raise ValueError(
                f"GraphKey needs 1 <= num_reqs_padded <= num_tokens_padded, got "
                f"{self.num_reqs_padded}, {self.num_tokens_padded}"
            )
        if self.max_len_bucket < 1:
            raise ValueError(f"max_len_bucket = {self.max_len_bucket}, expected >= 1")
        if not 0 <= self.shared_prefix < self.max_len_bucket:
            raise ValueError(f"shared_prefix = {self.shared_prefix}, expected in [0, "
                             f"max_len_bucket={self.max_len_bucket})")
        if self.uniform_decode and self.num_tokens_padded % self.num_reqs_padded:
            raise ValueError(
                f"uniform key: num_tokens_padded {self.num_tokens_padded} is not a multiple of "
                f"num_reqs_padded {self.num_reqs_padded}"
            )

    @property
    def query_len(self) -> int:
        """Tokens per row of a uniform key (0 for a mixed key)."""
        return self.num_tokens_padded // self.num_reqs_padded if self.uniform_decode else 0

    def __str__(self) -> str:
        kind = f"decode q={self.query_len}" if self.uniform_decode else "mixed"
        shared = f" shared prefix {self.shared_prefix}" if self.shared_prefix else ""
        return (f"reqs={self.num_reqs_padded} tokens={self.num_tokens_padded} "
                f"len<={self.max_len_bucket} {kind}{shared}")


def capture_order(key: GraphKey) -> tuple[int, int, int, bool, int]:
    """Sort key of graph keys by size (capture goes largest first: later, smaller graphs
    reuse the pool's memory)."""
    return (key.num_tokens_padded, key.num_reqs_padded, key.max_len_bucket,
            key.uniform_decode, key.shared_prefix)


@dataclass(frozen=True, slots=True)
class BatchShape:
    """The CPU numbers of one step that pick its graph key.

    Produced once per step by `BatchShape.of` and used by dispatch, planning
    and data-parallel agreement alike.

    Attributes
    ----------
    num_reqs, num_tokens : int
        Real (unpadded) rows and query tokens.
    max_seq_len : int
        Max of the CPU upper bound.
    uniform_decode : bool
        At least one row, and every row has exactly the decode query length.
    seq_lens_upper_bound : np.ndarray or None
        int32 [num_reqs]: num_computed_tokens_cpu + num_scheduled_tokens per row
        (None for a shape agreed across ranks, which has no rows of its own).
    shared_prefix : int
        Tokens of a prefix a group of its rows shares (`graphattn.cascade`); 0: none.
    """

    num_reqs: int
    num_tokens: int
    max_seq_len: int
    uniform_decode: bool
    seq_lens_upper_bound: np.ndarray | None = field(default=None, compare=False, repr=False)
    shared_prefix: int = 0

    def __post_init__(self) -> None:
        if min(self.num_reqs, self.num_tokens, self.max_seq_len) < 0:
            raise ValueError(
                f"BatchShape needs num_reqs, num_tokens, max_seq_len >= 0, got "
                f"{self.num_reqs}, {self.num_tokens}, {self.max_seq_len}"
            )
        if self.num_tokens < self.num_reqs:
            raise ValueError(
                f"BatchShape needs num_tokens >= num_reqs, got {self.num_tokens} < {self.num_reqs}"
            )

    @classmethod
    def of(cls, num_computed_tokens_cpu: np.ndarray, req_slots: np.ndarray,
           num_scheduled_tokens: np.ndarray, decode_query_len: int = 1) -> BatchShape:
        """The shape of a schedule over the CPU mirror (numpy only).

        Parameters
        ----------
        num_computed_tokens_cpu : np.ndarray
            int32 [max_num_reqs]: the CPU mirror (an upper bound).
        req_slots, num_scheduled_tokens : np.ndarray
            int32 [num_reqs]: the schedule.
        decode_query_len : int
            Tokens per row of a uniform decode (1 + speculative tokens).
        """
        bound = np.add(num_computed_tokens_cpu.take(req_slots), num_scheduled_tokens,
                       dtype=np.int64)
        n = int(req_slots.shape[0])
        if not n:
            return cls(0, 0, 0, False, bound)
        tokens = int(num_scheduled_tokens.sum())
        # every row has q tokens iff they sum to n q and none has more
        uniform = tokens == n * decode_query_len and int(
            num_scheduled_tokens.max()) == decode_query_len
        return cls(n, tokens, int(bound.max()), uniform, bound)
