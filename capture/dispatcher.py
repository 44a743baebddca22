"""GraphKey of a batch, chosen from CPU numbers only."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from graphattn.buckets import BucketPolicy, LengthBuckets, pad_to_capture_size, validate_sizes
from graphattn.config import RunnerConfig
from graphattn.keys import BatchShape, CaptureSupport, CUDAGraphMode, GraphKey, capture_order

__all__ = ["CaptureSupport", "GraphDispatcher", "GraphKey"]


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
    mode : CUDAGraphMode
        Which kinds of keys exist; the order is exact full key, relaxed (mixed)
        full key, piecewise key, eager.
    piecewise_token_sizes : sequence of int
        Padded token counts of piecewise keys: ``GraphKey(t, t, max_model_len,
        False)``, whose plan (no decode path, the longest bucket) does not depend
        on the batch, so the pieces' shapes depend on t alone.
    shared_prefix_sizes : sequence of int
        Shared-prefix lengths of uniform-decode keys with shared-prefix attention
        (`graphattn.cascade`): each decode key also exists once per size below its bucket.
    """

    def __init__(
        self,
        capture_sizes: Sequence[int],
        length_buckets: LengthBuckets,
        decode_query_len: int = 1,
        mixed_token_sizes: Sequence[int] = (),
        capture_support: CaptureSupport = CaptureSupport.ALWAYS,
        mode: CUDAGraphMode | str = CUDAGraphMode.FULL_AND_PIECEWISE,
        piecewise_token_sizes: Sequence[int] = (),
        shared_prefix_sizes: Sequence[int] = (),
    ) -> None:
        self.shared_prefix_sizes = (validate_sizes("shared_prefix_sizes", shared_prefix_sizes)
                                    if shared_prefix_sizes else ())
        try:
            self.mode = CUDAGraphMode(mode)
        except ValueError:
            raise ValueError(f"mode = {mode!r}, expected one of "
                             f"{[m.value for m in CUDAGraphMode]}") from None
        self.piecewise_token_sizes = (
            validate_sizes("piecewise_token_sizes", piecewise_token_sizes)
            if piecewise_token_sizes and self.mode.has_piecewise else ())
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
        if capture_support < CaptureSupport.ALWAYS or self.mode in (
                CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
            self.mixed_token_sizes = ()
        if not self.mode.has_full:
            self.capture_sizes_allowed = False
        self._memo: dict[tuple[int, int, int, bool], GraphKey | None] = {}

    @classmethod
    def from_policy(cls, policy: BucketPolicy, max_model_len: int,
                    capture_support: CaptureSupport = CaptureSupport.ALWAYS,
                    mode: CUDAGraphMode | str = CUDAGraphMode.FULL_AND_PIECEWISE,
                    max_num_reqs: int | None = None) -> GraphDispatcher:
        """The dispatcher of a BucketPolicy for lengths up to `max_model_len`.

        With `max_num_reqs`, capture sizes no batch can pad to are dropped: those above
        the smallest size >= max_num_reqs.
        """
        sizes = policy.capture_sizes
        if max_num_reqs is not None:
            top = pad_to_capture_size(max_num_reqs, sizes)
            sizes = tuple(s for s in sizes if top is None or s <= top)
        return cls(sizes, LengthBuckets(max_model_len, policy.length_boundaries),
                   policy.decode_query_len, policy.mixed_token_sizes, capture_support, mode,
                   policy.piecewise_token_sizes, policy.shared_prefix_sizes)

    @classmethod
    def for_runner(cls, config: RunnerConfig, max_model_len: int, max_num_reqs: int,
                   capture_support: CaptureSupport,
                   given: GraphDispatcher | None = None) -> GraphDispatcher:
        """The dispatcher of a runner: `given`, or one from the config's policy and mode
        (ValueError when both a dispatcher and a non-default policy or mode are given)."""
        if given is None:
            return cls.from_policy(config.policy, max_model_len, capture_support,
                                   config.cudagraph_mode, max_num_reqs)
        default = RunnerConfig()
        if (config.policy, config.cudagraph_mode) != (default.policy, default.cudagraph_mode):
            raise ValueError("a dispatcher decides the keys: give it or config.policy / "
                             "config.cudagraph_mode, not both")
        return given

    def is_piecewise(self, key: GraphKey | None) -> bool:
        """`key` is a piecewise key (its step runs the piecewise-compiled model eagerly)."""
        return (key is not None and not key.uniform_decode and self.piecewise_token_sizes != ()
                and key.max_len_bucket == self.length_buckets.max_model_len
                and key.num_tokens_padded in self.piecewise_token_sizes
                and key.num_tokens_padded not in self.mixed_token_sizes)

    def piecewise_keys(self) -> list[GraphKey]:
        """Every piecewise key, largest first."""
        top = self.length_buckets.max_model_len
        return [GraphKey(t, t, top, False) for t in sorted(self.piecewise_token_sizes,
                                                             reverse=True)]

    def dispatch_shape(self, shape: BatchShape) -> GraphKey | None:
        """`dispatch` of a BatchShape (a uniform flag for another query length counts as mixed)."""
        q = self.decode_query_len
        # an empty batch (a dummy run) fits any key: the smallest uniform one when there is one
        uniform = shape.num_reqs == 0 or (
            shape.uniform_decode and shape.num_tokens == shape.num_reqs * q)
        key = self.dispatch(shape.num_reqs, shape.num_tokens, shape.max_seq_len, uniform)
        if shape.shared_prefix and key is not None and key.uniform_decode and (
                shape.shared_prefix in self.shared_prefix_sizes
                and shape.shared_prefix < key.max_len_bucket):
            return dataclasses.replace(key, shared_prefix=shape.shared_prefix)
        return key

    @staticmethod
    def check_fits(key: GraphKey, shape: BatchShape) -> None:
        """Raise ValueError unless a batch of `shape` can run padded to `key`."""
        problems = []
        if shape.num_reqs > key.num_reqs_padded or shape.num_tokens > key.num_tokens_padded:
            problems.append(f"{shape.num_reqs} requests / {shape.num_tokens} tokens exceed it")
        if shape.max_seq_len > key.max_len_bucket:
            problems.append(f"max length {shape.max_seq_len} exceeds its bucket")
        if key.uniform_decode and shape.num_reqs and not (
                shape.uniform_decode and shape.num_tokens == shape.num_reqs * key.query_len):
            problems.append(f"the batch is not a uniform decode of {key.query_len} tokens per row")
        if problems:
            raise ValueError(f"batch does not fit the key {key}: {'; '.join(problems)}")

    def all_keys(self) -> list[GraphKey]:
        """Every key to capture, largest first."""
        keys: list[GraphKey] = []
        q = self.decode_query_len
        for b in self.length_buckets.boundaries:
            if self.capture_sizes_allowed:
                keys += [GraphKey(r, r * q, b, True, p) for r in self.capture_sizes
                         for p in (0, *self.shared_prefix_sizes) if p < b]
            keys += [GraphKey(t, t, b, False) for t in self.mixed_token_sizes]
        return sorted(keys, key=capture_order, reverse=True)

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
        memo = (num_reqs, num_tokens, bucket, uniform_decode)
        try:
            return self._memo[memo]
        except KeyError:
            if len(self._memo) >= 4096:
                self._memo.clear()
            key = self._memo[memo] = self._pick(num_reqs, num_tokens, bucket, uniform_decode)
            return key

    def _pick(self, num_reqs: int, num_tokens: int, bucket: int,
              uniform_decode: bool) -> GraphKey | None:
        if uniform_decode and self.capture_sizes_allowed:
            r = pad_to_capture_size(max(num_reqs, 1), self.capture_sizes)
            if r is not None:
                return GraphKey(r, r * self.decode_query_len, bucket, True)
        if self.mixed_token_sizes:
            t = pad_to_capture_size(max(num_tokens, 1), self.mixed_token_sizes)
            if t is not None:
                return GraphKey(t, t, bucket, False)
        if self.piecewise_token_sizes:
            t = pad_to_capture_size(max(num_tokens, 1), self.piecewise_token_sizes)
            if t is not None:
                return GraphKey(t, t, self.length_buckets.max_model_len, False)
        return None
