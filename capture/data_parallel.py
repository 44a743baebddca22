"""Data-parallel ranks agree on one graph key from CPU numbers (gloo all-reduce)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from graphattn.capture.dispatcher import GraphDispatcher
from graphattn.keys import BatchShape, GraphKey

__all__ = ["BatchShape", "agree_on_shape", "dispatch_across_ranks"]


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
    return dispatcher.dispatch_shape(agreed), agreed
