"""Which decode rows of a step share a prefix, from the CPU block tables (no device read).

Shared-prefix (cascade) attention reads a prefix that a group of rows shares once per KV
head for the whole group, each row's own suffix separately, and merges the two by their
log-sum-exp. The rule that picks the group, per uniform-decode step:

1. the group is the rows whose first block is the most common first block of the step
   (ties: the smallest block id); fewer than 2 rows: no group;
2. the shared prefix is the group's longest common run of block ids, cut to the full blocks
   below every member's lower-bound computed tokens (read-only blocks, written by no row
   of the step) and to the blocks each member holds;
3. its length is rounded down to the largest of the policy's `shared_prefix_sizes` (0: none
   fits): the prefix the step's key is captured for. Rows share at least that many tokens,
   so the prefix pass reads exactly those positions and each member's suffix pass the rest.
"""

from __future__ import annotations

import numpy as np

from graphattn.state import RequestState

__all__ = ["plan_shared_prefix"]


def plan_shared_prefix(state: RequestState, req_slots: np.ndarray,
                       sizes: tuple[int, ...]) -> tuple[int, np.ndarray | None]:
    """The step's shared prefix (tokens, one of `sizes` or 0) and its group (bool [rows]).

    Parameters
    ----------
    state : RequestState
        Its CPU block tables and mirror are read.
    req_slots : np.ndarray
        int32 [rows], the step's rows.
    sizes : tuple[int, ...]
        Sorted shared-prefix lengths the keys exist for.

    Returns
    -------
    (int, np.ndarray or None)
        0 and None when no group of 2 rows shares one of `sizes`.
    """
    if not sizes or req_slots.shape[0] < 2:
        return 0, None
    first = state.block_table_np[req_slots, 0]
    values, counts = np.unique(first, return_counts=True)
    members = first == values[np.argmax(counts)]
    if members.sum() < 2:
        return 0, None
    slots = req_slots[members]
    table = state.block_table_np[slots]
    same = (table == table[0]).all(0)
    common = int(same.size if same.all() else np.argmin(same))
    readable = min(int(state.lower_bounds(slots).min()) // state.block_size,
                   int(state.num_blocks_np[slots].min()))
    shared = min(common, readable) * state.block_size
    fits = [s for s in sizes if s <= shared]
    return (fits[-1], members) if fits else (0, None)
