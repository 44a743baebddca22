"""Micro-batch slicing of CommonAttentionMetadata."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from graphattn.checks import as_index
from graphattn.metadata import CommonAttentionMetadata

__all__ = [
    "UBatchSlice",
    "make_metadata_with_slice",
    "maybe_create_ubatch_slices",
    "slice_query_start_locs",
    "split_attn_metadata",
]


@dataclass(frozen=True, slots=True)
class UBatchSlice:
    """Requests [request_slice) and tokens [token_slice) of one micro-batch.

    The token range may start inside the first request and end inside the
    last one; both slices have step 1 and 0 <= start <= stop.
    """

    request_slice: slice
    token_slice: slice

    def __post_init__(self) -> None:
        for name in ("request_slice", "token_slice"):
            s = getattr(self, name)
            if not isinstance(s, slice) or s.start is None or s.stop is None:
                raise ValueError(f"{name} must be a slice with start and stop, got {s!r}")
            if s.step not in (None, 1) or not 0 <= s.start <= s.stop:
                raise ValueError(f"{name} must have step 1 and 0 <= start <= stop, got {s!r}")

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start

    @property
    def num_reqs(self) -> int:
        return self.request_slice.stop - self.request_slice.start


def slice_query_start_locs(query_start_loc: torch.Tensor, request_slice: slice) -> torch.Tensor:
    """query_start_loc of requests [request_slice), rebased to start at 0.

    Parameters
    ----------
    query_start_loc : torch.Tensor
        int32 [num_reqs + 1], any device.
    request_slice : slice

    Returns
    -------
    torch.Tensor
        int32 [len(request_slice) + 1], same device.
    """
    if query_start_loc.ndim != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be 1-D with num_reqs + 1 >= 1 entries, got "
                         f"shape {tuple(query_start_loc.shape)}")
    n = query_start_loc.shape[0] - 1
    if not 0 <= request_slice.start <= request_slice.stop <= n:
        raise ValueError(f"request_slice {request_slice} out of range for {n} requests")
    part = query_start_loc[request_slice.start : request_slice.stop + 1]
    return part - query_start_loc[request_slice.start]


def _sliced_query_starts(ubatch_slice: UBatchSlice, m: CommonAttentionMetadata,
                         qsl_full: np.ndarray) -> tuple[np.ndarray, int]:
    """The slice's query_start_loc on CPU and the end of its real tokens; ValueError for a
    slice out of range, across later requests' tokens, or emptying one of its requests."""
    rs, re = ubatch_slice.request_slice.start, ubatch_slice.request_slice.stop
    ts, te = ubatch_slice.token_slice.start, ubatch_slice.token_slice.stop
    if re > m.num_reqs:
        raise ValueError(f"request_slice {ubatch_slice.request_slice} out of range: "
                         f"metadata has {m.num_reqs} requests")
    if te > m.num_tokens_padded:
        raise ValueError(f"token_slice {ubatch_slice.token_slice} out of range: "
                         f"metadata has {m.num_tokens_padded} tokens")
    first_start, last_end = int(qsl_full[rs]), int(qsl_full[re])
    real_total = int(qsl_full[-1])
    # past last_end only padded tokens may follow (no real token of a later request)
    if re > rs and not (first_start <= ts and (te <= last_end or last_end == real_total)):
        raise ValueError(
            f"token_slice {ubatch_slice.token_slice} is not inside the tokens "
            f"[{first_start}, {last_end}) of request_slice {ubatch_slice.request_slice}"
            + (" (tokens of later requests follow)" if te > last_end else "")
        )
    real_end = min(te, real_total)
    qsl_cpu = np.clip(qsl_full[rs : re + 1], ts, max(real_end, ts)) - ts
    emptied = (np.diff(qsl_full[rs : re + 1]) > 0) & (np.diff(qsl_cpu) == 0)
    if emptied.any():
        i = rs + int(np.argmax(emptied))
        raise ValueError(
            f"token_slice {ubatch_slice.token_slice} leaves request {i} of request_slice "
            f"{ubatch_slice.request_slice} with no query token (its tokens are "
            f"[{qsl_full[i]}, {qsl_full[i + 1]})): drop it from the request slice"
        )
    return qsl_cpu, real_end


def make_metadata_with_slice(
    ubatch_slice: UBatchSlice, attn_metadata: CommonAttentionMetadata
) -> CommonAttentionMetadata:
    """Metadata of one micro-batch.

    A token range that starts inside the first request drops that request's
    earlier query tokens (they run in the previous micro-batch; its length is
    unchanged). One that ends inside the last request drops the later query
    tokens and shortens that request's seq len and bound by as many. Trimmed
    tensors are clones: `attn_metadata` is unchanged. Everything is computed
    from CPU numbers and device ops, with no device read.
    """
    rs, re = ubatch_slice.request_slice.start, ubatch_slice.request_slice.stop
    ts, te = ubatch_slice.token_slice.start, ubatch_slice.token_slice.stop
    m = attn_metadata
    qsl_full = m.query_start_loc_cpu.numpy()
    qsl_cpu, real_end = _sliced_query_starts(ubatch_slice, m, qsl_full)
    last_end = int(qsl_full[re])
    qsl_dev = torch.clamp(m.query_start_loc[rs : re + 1], min=ts, max=max(real_end, ts)) - ts
    trim_last = max(last_end - real_end, 0) if re > rs else 0

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t[rs:re]
        if trim_last:
            t = t.clone()
            t[-1:].sub_(trim_last)
        return t

    bound = cut(m.seq_lens_cpu_upper_bound)
    qlens = np.diff(qsl_cpu)
    max_query_len = int(qlens.max(initial=0))
    if max_query_len == 0:
        # All-padded (dummy) micro-batch: keep the parent's value so kernels
        # sized by it see the same shape as in the capture.
        max_query_len = m.max_query_len
    exact = cut(m._seq_lens_cpu)
    computed = None
    if exact is not None and m._num_computed_tokens_cpu is not None:
        computed = torch.from_numpy((exact.numpy() - qlens).astype(np.int32))
    return dataclasses.replace(
        m,
        query_start_loc=qsl_dev,
        query_start_loc_cpu=torch.from_numpy(qsl_cpu.astype(np.int32)),
        seq_lens=cut(m.seq_lens),
        seq_lens_cpu_upper_bound=bound,
        num_reqs=re - rs,
        num_actual_tokens=int(qsl_cpu[-1]),
        max_query_len=max_query_len,
        max_seq_len=int(bound.numpy().max(initial=0)),
        block_table_tensor=m.block_table_tensor[rs:re],
        slot_mapping=m.slot_mapping[ts:te],
        _seq_lens_cpu=exact,
        _num_computed_tokens_cpu=computed,
    )


def split_attn_metadata(
    ubatch_slices: list[UBatchSlice], common_attn_metadata: CommonAttentionMetadata
) -> list[CommonAttentionMetadata]:
    """One CommonAttentionMetadata per slice (see `make_metadata_with_slice`).

    The token slices must follow each other (each starts where the previous stopped).
    """
    for a, b in zip(ubatch_slices, ubatch_slices[1:], strict=False):
        if b.token_slice.start != a.token_slice.stop or \
                b.request_slice.start < a.request_slice.start:
            raise ValueError(
                f"ubatch slices must be consecutive and increasing: {a} then {b}"
            )
    return [make_metadata_with_slice(s, common_attn_metadata) for s in ubatch_slices]


def maybe_create_ubatch_slices(
    query_start_loc_np: np.ndarray,
    num_ubatches: int,
    num_tokens_padded: int | None = None,
) -> list[UBatchSlice] | None:
    """Split a padded batch into `num_ubatches` micro-batches of equal token count.

    Parameters
    ----------
    query_start_loc_np : np.ndarray
        int32 [num_reqs_padded + 1]; padded rows have zero query tokens.
    num_ubatches : int
        >= 1. With 1, or fewer padded tokens than micro-batches, returns None.
    num_tokens_padded : int, optional
        Padded token count (default: query_start_loc_np[-1]).

    Returns
    -------
    list[UBatchSlice] or None
        Token ranges split evenly; a boundary may fall inside a request, which
        then appears in both neighbours. Padded rows go to the last micro-batch.
    """
    qsl = np.asarray(query_start_loc_np)
    if qsl.ndim != 1 or qsl.shape[0] < 1 or (qsl.size and qsl.dtype.kind not in "iu"):
        raise ValueError(f"query_start_loc_np must be 1-D integer with num_reqs_padded + 1 >= 1 "
                         f"entries, got shape {qsl.shape} dtype {qsl.dtype}")
    if qsl[0] != 0 or (np.diff(qsl) < 0).any():
        raise ValueError(f"query_start_loc_np must start at 0 and never decrease, got "
                         f"{qsl[:16].tolist()}")
    num_ubatches = as_index("num_ubatches", num_ubatches, 1)
    total = int(qsl[-1]) if num_tokens_padded is None else as_index(
        "num_tokens_padded", num_tokens_padded, 0)
    if total < int(qsl[-1]):
        raise ValueError(f"num_tokens_padded = {total} is below the real tokens {int(qsl[-1])}")
    if num_ubatches == 1 or total < num_ubatches:
        return None
    num_reqs_padded = qsl.shape[0] - 1
    real = int(qsl[-1])
    num_real_reqs = int(np.searchsorted(qsl, real, side="left")) if real else 0
    bounds = (np.arange(num_ubatches + 1) * total) // num_ubatches
    clipped = np.minimum(bounds, real)
    # Row holding token b (for b < real), or the first padded row.
    starts = np.searchsorted(qsl[1 : num_real_reqs + 1], clipped, side="right")
    ends = starts.copy()
    inside = (clipped > qsl[np.minimum(starts, num_reqs_padded)]) & (clipped < real)
    ends[inside] += 1
    req_starts, req_stops = starts[:-1], ends[1:]
    req_stops[-1] = num_reqs_padded
    return [
        UBatchSlice(slice(int(a), int(b)), slice(int(t0), int(t1)))
        for a, b, t0, t1 in zip(req_starts, req_stops, bounds[:-1], bounds[1:], strict=True)
    ]
