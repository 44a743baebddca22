"""GraphKey of a batch, chosen from CPU numbers only."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from capture.buckets import LengthBuckets, pad_to_capture_size, validate_sizes

__all__ = ["CaptureSupport", "GraphDispatcher", "GraphKey"]


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
    """

    num_reqs_padded: int
    num_tokens_padded: int
    max_len_bucket: int
    uniform_decode: bool

    def __post_init__(self) -> None:
        if self.num_reqs_padded < 1 or self.num_tokens_padded < self.num_reqs_padded:
            raise ValueError(
                f"GraphKey needs 1 <= num_reqs_padded <= num_tokens_padded, got "
                f"{self.num_reqs_padded}, {self.num_tokens_padded}"
            )
        if self.max_len_bucket < 1:
            raise ValueError(f"max_len_bucket = {self.max_len_bucket}, expected >= 1")
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
        return (f"reqs={self.num_reqs_padded} tokens={self.num_tokens_padded} "
                f"len<={self.max_len_bucket} {kind}")


class GraphDispatcher:
    """Maps CPU batch numbers to a GraphKey, or None for eager.

    Parameters
    ----------
    capture_sizes : sequence of int
        Padded request counts of uniform-decode graphs (sorted, unique, > 0).
    length_buckets : LengthBuckets
    decode_query_len : int
        1 + number of speculative tokens: tokens per row of a uniform decode.
    mixed_token_sizes : sequence of int, optional
        Padded token counts of mixed (prefill + decode) graphs. The key of a
        mixed batch is relaxed to num_reqs_padded = num_tokens_padded, so one
        graph serves every split of those tokens into requests. Empty: mixed
        batches run eager.
    capture_support : CaptureSupport
        The attention backend's level, which the dispatcher honours.
    """

    def __init__(
        self,
        capture_sizes: Sequence[int],
        length_buckets: LengthBuckets,
        decode_query_len: int = 1,
        mixed_token_sizes: Sequence[int] = (),
        capture_support: CaptureSupport = CaptureSupport.ALWAYS,
    ) -> None:
        if decode_query_len < 1:
            raise ValueError(f"decode_query_len = {decode_query_len}, expected >= 1")
        self.capture_sizes = validate_sizes("capture_sizes", capture_sizes)
        self.mixed_token_sizes = (
            validate_sizes("mixed_token_sizes", mixed_token_sizes) if mixed_token_sizes else ()
        )
        self.length_buckets = length_buckets
        self.decode_query_len = decode_query_len
        self.capture_support = CaptureSupport(capture_support)
        if decode_query_len > 1 and capture_support == CaptureSupport.UNIFORM_SINGLE_TOKEN_DECODE:
            self.capture_sizes_allowed = False
        else:
            self.capture_sizes_allowed = capture_support > CaptureSupport.NEVER
        if capture_support < CaptureSupport.ALWAYS:
            self.mixed_token_sizes = ()

    def all_keys(self) -> list[GraphKey]:
        """Every key to capture, largest first."""
        keys: list[GraphKey] = []
        q = self.decode_query_len
        for b in self.length_buckets.boundaries:
            if self.capture_sizes_allowed:
                keys += [GraphKey(r, r * q, b, True) for r in self.capture_sizes]
            keys += [GraphKey(t, t, b, False) for t in self.mixed_token_sizes]
        return sorted(keys, key=lambda k: (k.num_tokens_padded, k.num_reqs_padded,
                                           k.max_len_bucket, k.uniform_decode), reverse=True)

    def dispatch(self, num_reqs: int, num_tokens: int, max_seq_len: int,
                 uniform_decode: bool) -> GraphKey | None:
        """Key for a batch, or None to run eager.

        Parameters
        ----------
        num_reqs, num_tokens : int
            Real (unpadded) sizes.
        max_seq_len : int
            Max of the CPU upper bound.
        uniform_decode : bool
            Every row has exactly `decode_query_len` tokens.
        """
        if num_reqs < 0 or num_tokens < num_reqs:
            raise ValueError(f"need 0 <= num_reqs <= num_tokens, got {num_reqs}, {num_tokens}")
        if uniform_decode and num_tokens != num_reqs * self.decode_query_len:
            raise ValueError(
                f"uniform decode of {num_reqs} requests must have "
                f"{num_reqs * self.decode_query_len} tokens, got {num_tokens}"
            )
        bucket = self.length_buckets.bucket(max_seq_len)
        if uniform_decode and self.capture_sizes_allowed:
            r = pad_to_capture_size(num_reqs, self.capture_sizes)
            if r is not None:
                return GraphKey(r, r * self.decode_query_len, bucket, True)
        if self.mixed_token_sizes:
            t = pad_to_capture_size(max(num_tokens, 1), self.mixed_token_sizes)
            if t is not None:
                return GraphKey(t, t, bucket, False)
        return None
