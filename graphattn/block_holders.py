"""Who holds each KV-cache block: live requests may share a block while it is read-only for
every holder (a prefix-cache hit), checked from CPU numbers only.

A block is read-only for a request when it is full and lies below the request's lower bound
of computed tokens (mirror - pending drafts: the truth is never below it, and it never
decreases). A request writes only at positions at or past its truth, so a shared block that
is read-only for all holders when it is shared stays unwritten for as long as it is shared.
Reference counts for reuse are the caller's (`graphattn.blocks.BlockManager` keeps them):
this table only says who holds what among live requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["BlockHolders", "SharePlan"]


@dataclass(frozen=True, slots=True)
class SharePlan:
    """What admitting blocks changes: the new holder's write floor and other holders'."""

    floor: int
    slots: np.ndarray
    slot_floors: np.ndarray


class BlockHolders:
    """Live holders per block and the first position each slot may write.

    Parameters
    ----------
    num_kv_blocks, max_num_reqs, block_size : int

    Attributes
    ----------
    count : np.ndarray
        int32 [num_kv_blocks + 1]: live requests holding each block (the sink last).
    write_floor : np.ndarray
        int64 [max_num_reqs]: positions below it are in blocks the slot shares.
    """

    def __init__(self, num_kv_blocks: int, max_num_reqs: int, block_size: int) -> None:
        self.block_size = block_size
        self.count = np.zeros(num_kv_blocks + 1, dtype=np.int32)
        self.write_floor = np.zeros(max_num_reqs, dtype=np.int64)

    def plan(self, req_id: str, blocks: np.ndarray, first_col: int, lower: int,
             slots: np.ndarray, table: np.ndarray, lowers: np.ndarray) -> SharePlan:
        """Check blocks a request gets at columns first_col.. (ValueError, nothing changed).

        Parameters
        ----------
        blocks : int32 [n]; first_col : int
        lower : int
            The request's lower bound of computed tokens (its num_computed_tokens).
        slots : int [R]
            The other live requests' slots.
        table : int32 [R, B]
            Their held blocks (sink past each one's count).
        lowers : int64 [R]
            Their lower bounds (mirror - pending drafts).
        """
        bs = self.block_size
        shared = self.count[blocks] > 0
        if not shared.any():
            return SharePlan(0, np.zeros(0, np.int64), np.zeros(0, np.int64))
        ends = (first_col + np.flatnonzero(shared) + 1) * bs
        if (ends > lower).any():
            bad = blocks[shared][ends > lower]
            raise ValueError(
                f"request {req_id!r}: blocks {bad.tolist()} are held by another live request; "
                f"a request shares only full blocks below its num_computed_tokens ({lower}), "
                "which it never writes")
        rows, cols = np.nonzero(np.isin(table, blocks[shared]))
        row_ends = (cols + 1) * bs
        if (row_ends > lowers[rows]).any():
            i = int(np.argmax(row_ends > lowers[rows]))
            raise ValueError(
                f"request {req_id!r}: block {table[rows[i], cols[i]]} is not read-only for "
                f"another live request yet (its tokens up to {row_ends[i]}, computed at least "
                f"{lowers[rows[i]]}): it may still write there")
        return SharePlan(int(ends.max()), slots[rows], row_ends)

    def add(self, slot: int, blocks: np.ndarray, plan: SharePlan) -> None:
        """Record `blocks` as held by `slot` (after `plan`)."""
        np.add.at(self.count, blocks, 1)
        self.write_floor[slot] = max(int(self.write_floor[slot]), plan.floor)
        if plan.slots.size:
            np.maximum.at(self.write_floor, plan.slots, plan.slot_floors)

    def remove(self, slot: int, blocks: np.ndarray) -> None:
        np.subtract.at(self.count, blocks, 1)
        self.write_floor[slot] = 0

    def check_writes(self, slots: np.ndarray, lowers: np.ndarray) -> None:
        """ValueError when a row could write below its write floor (inside a shared block)."""
        bad = lowers < self.write_floor[slots]
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"slot {slots[i]} could write at position {lowers[i]}, inside blocks it shares "
                f"with another live request (read-only below {self.write_floor[slots[i]]})")
