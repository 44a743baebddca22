"""Request slots and the CPU mirror of computed tokens.

The mirror `num_computed_tokens_np` is advanced optimistically by the
scheduled tokens after every step; the true count lives on the device
(`num_computed_tokens`) and is only ever updated by device ops. Without
speculative decoding both agree; with it the mirror is an upper bound until
`graphattn.spec_decode` corrects it on CPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from graphattn.block_holders import BlockHolders, SharePlan
from graphattn.checks import INT32_MAX, as_index, as_int32_array
from graphattn.keys import BatchShape
from graphattn.sync import note_host_read
from graphattn.transfer import to_device

__all__ = ["MirrorCheckpoint", "RequestState", "SchedulerOutput"]

# generations and state ids: unique in the process, so a step's feedback never matches
# another state's request (or another runner's)
_UNIQUE_IDS = itertools.count(1)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's schedule, as CPU numbers.

    Parameters
    ----------
    req_slots : np.ndarray
        int32 [num_reqs], the state slot of each scheduled request, in batch order.
    num_scheduled_tokens : np.ndarray
        int32 [num_reqs], tokens scheduled for each request this step (>= 1).
    num_draft_tokens : np.ndarray, optional
        int32 [num_reqs], speculative tokens among the scheduled ones (<= scheduled - 1).
    """

    req_slots: np.ndarray
    num_scheduled_tokens: np.ndarray
    num_draft_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        # fresh copies, range-checked before the int32 cast: later edits of the caller's
        # arrays cannot reach a validated schedule
        self.req_slots = as_int32_array("req_slots", self.req_slots, 0)
        self.num_scheduled_tokens = as_int32_array("num_scheduled_tokens",
                                                   self.num_scheduled_tokens, 1)
        n = self.req_slots.shape[0]
        if self.num_scheduled_tokens.shape[0] != n:
            raise ValueError(
                f"num_scheduled_tokens has {self.num_scheduled_tokens.shape[0]} entries, "
                f"expected {n} (one per req_slots entry)"
            )
        if n and np.unique(self.req_slots).size != n:
            raise ValueError(f"req_slots must be unique, got {self.req_slots.tolist()}")
        if self.num_draft_tokens is not None:
            self.num_draft_tokens = as_int32_array("num_draft_tokens", self.num_draft_tokens, 0)
            if self.num_draft_tokens.shape[0] != n:
                raise ValueError(
                    f"num_draft_tokens has {self.num_draft_tokens.shape[0]} entries, expected {n}"
                )
            bad = (self.num_draft_tokens < 0) | (self.num_draft_tokens >= self.num_scheduled_tokens)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(
                    f"num_draft_tokens[{i}] = {self.num_draft_tokens[i]}, expected in "
                    f"[0, {self.num_scheduled_tokens[i] - 1}] (scheduled minus one)"
                )

    @property
    def num_reqs(self) -> int:
        return int(self.req_slots.shape[0])

    @property
    def total_num_scheduled_tokens(self) -> int:
        return int(self.num_scheduled_tokens.sum())


@dataclass(frozen=True, slots=True)
class MirrorCheckpoint:
    """The mirror's rows of one schedule and the step count, before a step advanced them.

    Attributes
    ----------
    req_slots, num_computed_tokens, num_pending_drafts : np.ndarray
        int32 [num_reqs] (copies).
    num_steps : int
    """

    req_slots: np.ndarray
    num_computed_tokens: np.ndarray
    num_pending_drafts: np.ndarray
    num_steps: int


class RequestState:
    """Fixed-capacity table of live requests.

    Parameters
    ----------
    max_num_reqs : int
        Number of slots.
    max_model_len : int
        Longest sequence a request may reach.
    block_size : int
        Tokens per KV-cache block.
    device : torch.device or str
        Where the device copies (true computed counts, block table) live.
    num_kv_blocks : int, optional
        Blocks of the KV cache, the sink excluded (its index is `num_kv_blocks`).
        Default: max_num_reqs x max_num_blocks_per_req, the runner's default
        allocation. Block ids must be in [0, num_kv_blocks); table entries past
        a request's blocks point at the sink.

    Attributes
    ----------
    num_computed_tokens_np : np.ndarray
        int32 [max_num_reqs], CPU mirror: an upper bound of the true count.
    num_prompt_tokens_np : np.ndarray
        int32 [max_num_reqs].
    num_pending_drafts_np : np.ndarray
        int32 [max_num_reqs], draft tokens counted in the mirror whose
        verification has not reached the CPU yet (0: the mirror is exact).
    block_table_np : np.ndarray
        int32 [max_num_reqs, max_num_blocks_per_req].
    num_computed_tokens : torch.Tensor
        int32 [max_num_reqs] on `device`: the true count.
    block_table : torch.Tensor
        int32 [max_num_reqs, max_num_blocks_per_req] on `device`.
    num_blocks_np : np.ndarray
        int32 [max_num_reqs]: blocks each request owns.
    capacity_np : np.ndarray
        int64 [max_num_reqs]: tokens a request may reach now, min(its blocks x
        block_size, max_model_len); -1 for a free slot (kept by add / append / remove).
    generation_np : np.ndarray
        int64 [max_num_reqs]: a number no other request in the process had,
        given at admission (late feedback of a slot's previous occupant is told
        apart by it).
    num_steps : int
        Steps advanced so far (`advance_mirror` calls); a step's id is the value
        before its advance.
    awaiting_feedback : set of int
        Ids of the steps with drafts whose rejected counts have not been applied yet
        (`graphattn.spec_decode.apply_rejections` takes them in any order, each once).
    uid : int
        A number no other state in the process has (feedback carries it).

    Not thread-safe: one thread drives a state (the runner refuses concurrent steps).
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device | str = "cpu",
        num_kv_blocks: int | None = None,
    ) -> None:
        self.max_num_reqs = as_index("max_num_reqs", max_num_reqs, 1, 1 << 20)
        # positions, slots and lengths are int32 on the device
        self.max_model_len = as_index("max_model_len", max_model_len, 1, INT32_MAX // 2)
        self.block_size = as_index("block_size", block_size, 1, self.max_model_len)
        self.max_num_blocks_per_req = -(-self.max_model_len // self.block_size)
        if self.max_num_reqs * self.max_num_blocks_per_req > 1 << 28:
            raise ValueError(
                f"max_num_reqs x max_model_len / block_size = "
                f"{self.max_num_reqs * self.max_num_blocks_per_req} block-table entries, "
                f"expected <= {1 << 28}"
            )
        default_blocks = self.max_num_reqs * self.max_num_blocks_per_req
        self.num_kv_blocks = as_index("num_kv_blocks", default_blocks if num_kv_blocks is None
                                      else num_kv_blocks, 1, INT32_MAX - 1)
        self.device = torch.device(device)
        self.num_computed_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table_np = np.full((max_num_reqs, self.max_num_blocks_per_req),
                                      self.num_kv_blocks, dtype=np.int32)
        self.num_blocks_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_pending_drafts_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.generation_np = np.zeros(max_num_reqs, dtype=np.int64)
        self.awaiting_feedback: set[int] = set()
        self.uid = next(_UNIQUE_IDS)
        self.active_np = np.zeros(max_num_reqs, dtype=bool)
        self.capacity_np = np.full(max_num_reqs, -1, dtype=np.int64)
        self.num_steps = 0
        self.num_computed_tokens = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)
        self.block_table = torch.full((max_num_reqs, self.max_num_blocks_per_req),
                                      self.num_kv_blocks, dtype=torch.int32, device=self.device)
        self.req_id_to_slot: dict[str, int] = {}
        self.holders = BlockHolders(self.num_kv_blocks, max_num_reqs, self.block_size)

    @property
    def num_active(self) -> int:
        return len(self.req_id_to_slot)

    def add_request(
        self,
        req_id: str,
        num_prompt_tokens: int,
        block_ids: Sequence[int] | np.ndarray,
        num_computed_tokens: int = 0,
    ) -> int:
        """Put a request in a free slot and return the slot.

        Everything is validated before anything changes.

        Parameters
        ----------
        req_id : str
            Unique id.
        num_prompt_tokens : int
            Prompt length, 1..max_model_len.
        block_ids : sequence of int
            KV-cache blocks of the request (at most max_num_blocks_per_req,
            enough for the prompt, in [0, num_kv_blocks)); `append_blocks` adds more as
            it grows. A block another live request holds is shared when it is read-only
            for both (`graphattn.block_holders`): full, below this request's
            num_computed_tokens and below the other's computed tokens (a prefix-cache
            hit); reference counts for reuse are the caller's.
        num_computed_tokens : int
            Tokens already in the KV cache (prefix-cache hit, resume after
            preemption), < num_prompt_tokens.
        """
        if not isinstance(req_id, str):
            raise ValueError(f"req_id must be a str, got {req_id!r}")
        if req_id in self.req_id_to_slot:
            raise ValueError(f"request {req_id!r} is already in slot {self.req_id_to_slot[req_id]}")
        num_prompt_tokens = as_index("num_prompt_tokens", num_prompt_tokens, 1,
                                     self.max_model_len)
        num_computed_tokens = as_index("num_computed_tokens", num_computed_tokens, 0,
                                       num_prompt_tokens - 1)
        free = np.flatnonzero(~self.active_np)
        if free.size == 0:
            raise ValueError(f"no free slot: all {self.max_num_reqs} are in use")
        blocks, share = self._check_blocks(req_id, block_ids, 0, num_prompt_tokens,
                                           num_computed_tokens)
        slot = int(free[0])
        self.active_np[slot] = True
        self.req_id_to_slot[req_id] = slot
        self.num_prompt_tokens_np[slot] = num_prompt_tokens
        self.num_computed_tokens_np[slot] = num_computed_tokens
        self.num_pending_drafts_np[slot] = 0
        self.generation_np[slot] = next(_UNIQUE_IDS)
        self.num_blocks_np[slot] = blocks.shape[0]
        self._set_capacity(slot)
        self.holders.add(slot, blocks, share)
        self.block_table_np[slot] = self.num_kv_blocks
        self.block_table_np[slot, : blocks.shape[0]] = blocks
        self.block_table[slot].copy_(to_device(self.block_table_np[slot], self.device))
        self.num_computed_tokens[slot : slot + 1].fill_(num_computed_tokens)
        return slot

    def default_block_ids(self, num_prompt_tokens: int) -> np.ndarray:
        """Blocks for a new request when the caller gives none: the next free slot's own
        range (slot s: s*B .. s*B+B-1, B = max_num_blocks_per_req) when no live request
        holds any of it, else the lowest free ones (B of them, or as many as are free when
        they hold the prompt).

        Raises
        ------
        ValueError
            Not enough free blocks for the prompt.
        """
        b = self.max_num_blocks_per_req
        free = np.flatnonzero(~self.active_np)
        slot = int(free[0]) if free.size else 0
        held = self.holders.count > 0
        own = np.arange(slot * b, (slot + 1) * b)
        if own[-1] < self.num_kv_blocks and not held[own].any():
            return own
        unheld = np.flatnonzero(~held[: self.num_kv_blocks])[:b]
        need = -(-num_prompt_tokens // self.block_size)
        if unheld.size < need:
            raise ValueError(f"no block_ids given and {unheld.size} of {self.num_kv_blocks} "
                             f"blocks are free, expected >= {need} for a prompt of "
                             f"{num_prompt_tokens} tokens")
        return unheld

    def _check_blocks(self, req_id: str, block_ids: Sequence[int] | np.ndarray, have: int,
                      tokens: int, lower: int) -> tuple[np.ndarray, SharePlan]:
        """Validate blocks a request gets on top of its `have`, which must hold `tokens`
        (`lower`: its computed tokens; numpy, no state change)."""
        blocks = as_int32_array(f"block_ids of request {req_id!r}", block_ids, 0,
                                self.num_kv_blocks - 1)
        if have + blocks.shape[0] > self.max_num_blocks_per_req:
            raise ValueError(
                f"request {req_id!r}: {have} + {blocks.shape[0]} block ids, expected at most "
                f"{self.max_num_blocks_per_req} (max_model_len / block_size)"
            )
        need = -(-tokens // self.block_size)
        if have + blocks.shape[0] < need:
            raise ValueError(
                f"request {req_id!r}: {have + blocks.shape[0]} blocks of {self.block_size} "
                f"tokens for a prompt of {tokens} tokens, expected at least {need} blocks"
            )
        mine = self.req_id_to_slot.get(req_id, -1)
        own = self.block_table_np[mine, :have] if mine >= 0 else blocks[:0]
        if np.unique(np.concatenate([own, blocks])).size != have + blocks.size:
            raise ValueError(f"request {req_id!r}: block ids repeat (or are its own already): "
                             f"{blocks.tolist()}")
        live = np.flatnonzero(self.active_np)
        live = live[live != mine]
        return blocks, self.holders.plan(req_id, blocks, have, lower, live,
                                         self.block_table_np[live], self.lower_bounds(live))

    def lower_bounds(self, slots: np.ndarray) -> np.ndarray:
        """int64 [len(slots)]: mirror - pending drafts, which the true count never falls
        below (and which never decreases)."""
        computed = self.num_computed_tokens_np[slots].astype(np.int64)
        return computed - self.num_pending_drafts_np[slots]

    def append_blocks(self, req_id: str, block_ids: Sequence[int] | np.ndarray) -> None:
        """Give a running request more KV-cache blocks (validated first, as in add_request)."""
        if req_id not in self.req_id_to_slot:
            raise ValueError(f"unknown request {req_id!r}")
        slot = self.req_id_to_slot[req_id]
        have = int(self.num_blocks_np[slot])
        blocks, share = self._check_blocks(req_id, block_ids, have, 0,
                                           int(self.lower_bounds(np.array([slot]))[0]))
        n = blocks.shape[0]
        self.holders.add(slot, blocks, share)
        self.block_table_np[slot, have : have + n] = blocks
        self.num_blocks_np[slot] = have + n
        self._set_capacity(slot)
        self.block_table[slot].copy_(to_device(self.block_table_np[slot], self.device))

    def _set_capacity(self, slot: int) -> None:
        self.capacity_np[slot] = min(int(self.num_blocks_np[slot]) * self.block_size,
                                     self.max_model_len)

    def remove_request(self, req_id: str) -> int:
        """Free the slot of `req_id` and return it."""
        if req_id not in self.req_id_to_slot:
            raise ValueError(f"unknown request {req_id!r}")
        slot = self.req_id_to_slot.pop(req_id)
        self.holders.remove(slot, self.block_table_np[slot, : self.num_blocks_np[slot]])
        self.active_np[slot] = False
        self.num_computed_tokens_np[slot] = 0
        self.num_prompt_tokens_np[slot] = 0
        self.num_pending_drafts_np[slot] = 0
        self.num_blocks_np[slot] = 0
        self.capacity_np[slot] = -1
        self.prune_feedback()
        return slot

    def slots_of(self, req_ids: Sequence[str]) -> np.ndarray:
        """int32 [len(req_ids)] slots of the given requests."""
        missing = [r for r in req_ids if r not in self.req_id_to_slot]
        if missing:
            raise ValueError(f"unknown requests {missing}")
        return np.fromiter((self.req_id_to_slot[r] for r in req_ids), np.int32, len(req_ids))

    def check_schedule(self, sched: SchedulerOutput) -> None:
        """Raise ValueError if `sched` names free slots or runs past max_model_len."""
        self.batch_shape(sched)

    def check_known_tokens(self, sched: SchedulerOutput) -> None:
        """Raise ValueError for a row that would run tokens nobody has produced yet.

        A prefill row runs at most the rest of its prompt (prompt - computed); a decode row
        runs its last sampled token plus its drafts (1 + num_draft_tokens). Vectorized.
        """
        slots = sched.req_slots
        computed = self.num_computed_tokens_np[slots]
        self.holders.check_writes(slots, self.lower_bounds(slots))
        prompt = self.num_prompt_tokens_np[slots]
        drafts = 0 if sched.num_draft_tokens is None else sched.num_draft_tokens
        most = np.where(computed < prompt, prompt - computed, 1 + drafts)
        bad = sched.num_scheduled_tokens > most
        if bad.any():
            i = int(np.argmax(bad))
            kind = ("prefill row: at most prompt - computed" if computed[i] < prompt[i]
                    else "decode row: at most 1 + its num_draft_tokens")
            raise ValueError(
                f"num_scheduled_tokens[{i}] = {sched.num_scheduled_tokens[i]} for slot "
                f"{slots[i]} (prompt {prompt[i]}, computed {computed[i]}), expected <= "
                f"{most[i]} ({kind}): later tokens do not exist yet")

    def batch_shape(self, sched: SchedulerOutput, decode_query_len: int = 1) -> BatchShape:
        """Validate `sched` against the table and return its BatchShape (numpy only).

        The one producer of a step's upper bound, its max, the uniform flag and
        the counts: dispatch, planning and data-parallel agreement use it.

        Raises
        ------
        ValueError
            A slot out of range or free, or a row that would pass max_model_len.
        """
        slots = sched.req_slots
        try:  # the range check is the gather's: a negative int32 slot is >= 2**31 as uint32
            capacity = self.capacity_np.take(slots.astype(np.int32, copy=False).view(np.uint32))
        except IndexError:
            raise ValueError(
                f"req_slots must be in [0, {self.max_num_reqs}), got min {slots.min()} "
                f"max {slots.max()}"
            ) from None
        shape = BatchShape.of(self.num_computed_tokens_np, slots, sched.num_scheduled_tokens,
                              decode_query_len)
        ends = shape.seq_lens_upper_bound
        # one check for free slots, blocks and max_model_len (capacity: -1 when free)
        if not (ends > capacity).any():
            return shape
        inactive = ~self.active_np[slots]
        if inactive.any():
            raise ValueError(f"req_slots {slots[inactive].tolist()} hold no request")
        over = ends > self.max_model_len
        if over.any():
            i = int(np.argmax(over))
            raise ValueError(
                f"slot {slots[i]}: computed {self.num_computed_tokens_np[slots[i]]} + scheduled "
                f"{sched.num_scheduled_tokens[i]} = {ends[i]} exceeds max_model_len "
                f"{self.max_model_len}"
            )
        room = self.num_blocks_np[slots].astype(np.int64) * self.block_size
        i = int(np.argmax(ends > room))
        req = next((r for r, s in self.req_id_to_slot.items() if s == slots[i]), "?")
        raise ValueError(
            f"request {req!r} (slot {slots[i]}): {ends[i]} tokens after this step, but its "
            f"{self.num_blocks_np[slots[i]]} blocks hold {room[i]}; append_blocks first"
        )

    def advance_mirror(self, sched: SchedulerOutput, bound: np.ndarray | None = None) -> None:
        """CPU half of `postprocess`: advance the mirror optimistically (numpy only).

        `bound`: the schedule's `BatchShape.seq_lens_upper_bound` when the caller has it
        (the mirror's new values). A step with drafts awaits its feedback.
        """
        slots = sched.req_slots
        if bound is None:
            self.num_computed_tokens_np[slots] += sched.num_scheduled_tokens
        else:
            self.num_computed_tokens_np[slots] = bound
        if sched.num_draft_tokens is not None and sched.num_draft_tokens.any():
            self.num_pending_drafts_np[slots] += sched.num_draft_tokens
            self.awaiting_feedback.add(self.num_steps)
        self.num_steps += 1

    def checkpoint(self, sched: SchedulerOutput) -> MirrorCheckpoint:
        """What `advance_mirror(sched)` may change, for `restore` (numpy copies)."""
        slots = sched.req_slots
        return MirrorCheckpoint(slots, self.num_computed_tokens_np[slots],
                                self.num_pending_drafts_np[slots], self.num_steps)

    def restore(self, saved: MirrorCheckpoint) -> None:
        """Undo whatever part of `advance_mirror` ran after `saved` was taken (a step whose
        device work was never enqueued)."""
        self.num_computed_tokens_np[saved.req_slots] = saved.num_computed_tokens
        self.num_pending_drafts_np[saved.req_slots] = saved.num_pending_drafts
        self.awaiting_feedback.discard(saved.num_steps)
        self.num_steps = saved.num_steps

    def resync(self) -> None:
        """Set the CPU mirror to the device truth: one explicit, documented host sync.

        For recovery only (after a step was interrupted once its device work was
        enqueued); every pending draft is then counted as verified, so late feedback
        of earlier steps is refused as a duplicate.
        """
        note_host_read("RequestState.resync()")
        truth = self.num_computed_tokens.to("cpu").numpy()
        self.num_computed_tokens_np[self.active_np] = truth[self.active_np]
        self.num_pending_drafts_np[:] = 0
        self.awaiting_feedback.clear()

    def prune_feedback(self) -> None:
        """Forget awaited steps once no live request has drafts pending (their feedback
        could correct nothing)."""
        if self.awaiting_feedback and not self.num_pending_drafts_np[self.active_np].any():
            self.awaiting_feedback.clear()

    def advance_device(self, req_slots: torch.Tensor, num_scheduled: torch.Tensor,
                       num_rejected: torch.Tensor | None = None) -> None:
        """Device half of `postprocess` (capturable): truth += scheduled - rejected.

        Parameters
        ----------
        req_slots : torch.Tensor
            int [n] on device; padded rows may repeat a slot if they add 0.
        num_scheduled : torch.Tensor
            int32 [n] on device (0 in padded rows).
        num_rejected : torch.Tensor, optional
            int32 [n] on device.
        """
        delta = num_scheduled if num_rejected is None else num_scheduled - num_rejected
        self.num_computed_tokens.index_add_(0, req_slots.long(), delta.to(torch.int32))

    def postprocess(
        self,
        sched: SchedulerOutput,
        num_rejected: torch.Tensor | None = None,
        req_slots: torch.Tensor | None = None,
        num_scheduled: torch.Tensor | None = None,
    ) -> None:
        """Advance after a step: CPU mirror optimistically, device truth exactly.

        Parameters
        ----------
        sched : SchedulerOutput
            The step that ran.
        num_rejected : torch.Tensor, optional
            int32 [num_reqs] on device: draft tokens the verifier rejected. The
            CPU mirror ignores it (it is device state); `spec_decode` corrects
            the mirror once the counts reach the CPU.
        req_slots, num_scheduled : torch.Tensor, optional
            Device copies of the schedule (an InputBatch's, padded or not) to
            save an H2D copy; their first num_reqs rows are used.
        """
        self.advance_mirror(sched)
        n = sched.num_reqs
        if n == 0:
            return
        if req_slots is None:
            req_slots = to_device(sched.req_slots.astype(np.int64), self.device)
        if num_scheduled is None:
            num_scheduled = to_device(sched.num_scheduled_tokens, self.device)
        self.advance_device(req_slots[:n], num_scheduled[:n], num_rejected)

    def postprocess_pool(self, sched: SchedulerOutput) -> np.ndarray:
        """Advance after a step of a pooling model (no sampling, no drafts).

        Returns
        -------
        np.ndarray
            bool [num_reqs]: requests whose prompt is now fully computed.
        """
        if sched.num_draft_tokens is not None and sched.num_draft_tokens.any():
            raise ValueError("pooling models take no draft tokens")
        self.postprocess(sched)
        slots = sched.req_slots
        return self.num_computed_tokens_np[slots] >= self.num_prompt_tokens_np[slots]
