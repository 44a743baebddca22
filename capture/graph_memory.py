"""The graph pool's size before capture: an estimate from one eager step per key, and the
capture sizes that fit a memory budget.

Graphs captured largest first into one pool reuse each other's freed intermediates (they
never run at once); what each graph keeps is its outputs. So the pool needs about the
largest key's intermediates plus every key's outputs:

    pool ~ max_k (peak_k - outputs_k) + sum_k outputs_k

with peak_k the allocator's peak above the baseline during an eager step of key k at its
padded shapes (all rows padded: no state changes), rounded up to the allocator's 2 MiB
segments. A caller sizes its KV cache as ``free - weights - activations - estimate``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

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
    peak_bytes : tuple[int, ...]
        Allocator peak above the baseline during each key's eager step (0 off CUDA: no
        allocator statistics there, and no graph pool either).
    output_bytes : tuple[int, ...]
        Bytes of each key's outputs, which its graph keeps allocated.
    """

    keys: tuple[GraphKey, ...]
    peak_bytes: tuple[int, ...]
    output_bytes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        """max(peak - outputs) + sum(outputs), rounded up to 2 MiB (0 without keys)."""
        if not self.keys:
            return 0
        scratch = max(max(p - o, 0) for p, o in zip(self.peak_bytes, self.output_bytes,
                                                   strict=True))
        total = scratch + sum(self.output_bytes)
        return -(-total // SEGMENT) * SEGMENT

    def without(self, drop: set[GraphKey]) -> GraphMemoryEstimate:
        """The estimate of the keys not in `drop`."""
        rows = [r for r in zip(self.keys, self.peak_bytes, self.output_bytes, strict=True)
                if r[0] not in drop]
        return GraphMemoryEstimate(*(tuple(c) for c in zip(*rows, strict=True))) if rows \
            else GraphMemoryEstimate((), (), ())


def measure_keys(keys: Sequence[GraphKey], run: Callable[[GraphKey], object],
                 device: torch.device) -> GraphMemoryEstimate:
    """Run ``run(key)`` (an eager step at the key's padded shapes returning its outputs) once
    per key, largest first, and record its allocator peak and output bytes."""
    order = sorted(set(keys), key=capture_order, reverse=True)
    cuda = device.type == "cuda"
    peaks, outputs = [], []
    for key in order:
        if cuda:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        outs = run(key)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (outs if isinstance(outs, tuple) else (outs,))
                    if isinstance(t, torch.Tensor)}
        outputs.append(sum(storages.values()))
        if cuda:
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device) - base)
        else:
            peaks.append(0)
        del outs
    return GraphMemoryEstimate(tuple(order), tuple(peaks), tuple(outputs))


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
