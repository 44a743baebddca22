"""The graph pool's size before capture: an estimate from one dry-run capture per key, and
the capture sizes that fit a memory budget.

Graphs captured largest first into one pool reuse each other's freed intermediates (they
never run at once); what each graph keeps is its outputs. So the pool needs about the
largest key's scratch plus every key's kept outputs:

    pool ~ max_k (alone_k - kept_k) + sum_k kept_k

with alone_k the segments of key k's graph captured alone into a fresh pool (then
released): the allocator's rounding, the workspaces a capture allocates and everything the
graph's run allocates count as in the real capture. Outputs the manager does not keep (its
`scratch_outputs`: the runner's logits) count with the scratch. A caller sizes its KV
cache as ``free - weights - activations - estimate``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from graphattn.buckets import BucketPolicy
from graphattn.keys import GraphKey, capture_order

__all__ = ["GraphMemoryEstimate", "fit_capture_sizes", "measure_keys"]

SEGMENT = 2 << 20


@dataclass(frozen=True, slots=True)
class GraphMemoryEstimate:
    """Estimated graph-pool bytes of a set of keys.

    Attributes
    ----------
    keys : tuple[GraphKey, ...]
        Largest first (capture order).
    alone_bytes : tuple[int, ...]
        The pool segments of each key's graph captured alone (0 off CUDA: no graph pool).
    kept_bytes : tuple[int, ...]
        Bytes of each key's outputs that its graph keeps allocated.
    """

    keys: tuple[GraphKey, ...]
    alone_bytes: tuple[int, ...]
    kept_bytes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        """max(alone - kept) + sum(kept), rounded up to 2 MiB (0 without keys)."""
        if not self.keys:
            return 0
        scratch = max(max(a - k, 0) for a, k in zip(self.alone_bytes, self.kept_bytes,
                                                   strict=True))
        total = scratch + sum(self.kept_bytes)
        return -(-total // SEGMENT) * SEGMENT

    def without(self, drop: set[GraphKey]) -> GraphMemoryEstimate:
        """The estimate of the keys not in `drop`."""
        rows = [r for r in zip(self.keys, self.alone_bytes, self.kept_bytes, strict=True)
                if r[0] not in drop]
        return GraphMemoryEstimate(*(tuple(c) for c in zip(*rows, strict=True))) if rows \
            else GraphMemoryEstimate((), (), ())


def measure_keys(keys: Sequence[GraphKey],
                 capture_alone: Callable[[list[GraphKey]], list[tuple[int, int]]],
                 ) -> GraphMemoryEstimate:
    """The estimate of `keys` from ``capture_alone(keys)`` (`CUDAGraphManager.capture_alone`:
    per key, largest first, its pool bytes captured alone and its kept output bytes)."""
    order = sorted(set(keys), key=capture_order, reverse=True)
    sizes = capture_alone(order)
    return GraphMemoryEstimate(tuple(order), tuple(a for a, _ in sizes),
                               tuple(k for _, k in sizes))


def fit_capture_sizes(policy: BucketPolicy, estimate: GraphMemoryEstimate,
                      budget_bytes: int) -> BucketPolicy:
    """`policy` without its largest capture and mixed token sizes until the estimated pool of
    the keys left fits `budget_bytes` (the smallest capture size always stays).

    Raises
    ------
    ValueError
        When even the smallest capture size alone does not fit.
    """
    sizes = list(policy.capture_sizes)
    mixed = list(policy.mixed_token_sizes)

    def dropped() -> set[GraphKey]:
        return {k for k in estimate.keys if (k.num_reqs_padded not in sizes if k.uniform_decode
                                             else k.num_tokens_padded not in mixed)}

    while estimate.without(dropped()).total_bytes > budget_bytes:
        tops = [(sizes[-1] * policy.decode_query_len, "sizes")] if len(sizes) > 1 else []
        tops += [(mixed[-1], "mixed")] if mixed else []
        if not tops:
            raise ValueError(f"graph_memory budget {budget_bytes} bytes is below the estimate "
                             f"{estimate.without(dropped()).total_bytes} of the smallest "
                             f"capture size {sizes[0]} alone")
        (sizes if max(tops)[1] == "sizes" else mixed).pop()
    return dataclasses.replace(policy, capture_sizes=tuple(sizes),
                               mixed_token_sizes=tuple(mixed))
