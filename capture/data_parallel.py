"""Data-parallel ranks agree on one graph key from CPU numbers (gloo all-reduce)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from capture.dispatcher import GraphDispatcher, GraphKey

__all__ = ["BatchShape", "agree_on_shape", "dispatch_across_ranks"]


@dataclass(frozen=True, slots=True)
class BatchShape:
    """The CPU numbers that pick a graph key.

    Attributes
    ----------
    num_reqs, num_tokens, max_seq_len : int
        Real sizes and the upper-bound max length.
    uniform_decode : bool
    """

    num_reqs: int
    num_tokens: int
    max_seq_len: int
    uniform_decode: bool

    def __post_init__(self) -> None:
        if min(self.num_reqs, self.num_tokens, self.max_seq_len) < 0:
            raise ValueError(f"BatchShape fields must be >= 0, got {self}")


def agree_on_shape(shape: BatchShape, group: dist.ProcessGroup | None = None) -> BatchShape:
    """Max over ranks of every number (uniform only if uniform everywhere).

    One all-reduce of a CPU int64 tensor; `group` must be a CPU (gloo) group.
    No device state is read.
    """
    t = torch.tensor(
        [shape.num_reqs, shape.num_tokens, shape.max_seq_len, int(not shape.uniform_decode)],
        dtype=torch.int64,
    )
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    r, n, m, mixed = (int(x) for x in t.numpy())
    return BatchShape(r, n, m, not mixed)


def dispatch_across_ranks(
    dispatcher: GraphDispatcher, shape: BatchShape, group: dist.ProcessGroup | None = None
) -> tuple[GraphKey | None, BatchShape]:
    """The key every rank replays, and the agreed shape it came from.

    When ranks disagree on uniformity, all of them take the mixed key; when the
    agreed shape fits no graph, all run eager (None).
    """
    agreed = agree_on_shape(shape, group)
    uniform = agreed.uniform_decode and agreed.num_tokens == (
        agreed.num_reqs * dispatcher.decode_query_len
    )
    key = dispatcher.dispatch(agreed.num_reqs, agreed.num_tokens, agreed.max_seq_len, uniform)
    return key, agreed
