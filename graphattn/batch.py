"""prepare_inputs: scheduler output -> padded InputBatch, in two halves.

`plan_batch` is the CPU half (numpy, not capturable): padded sizes and one
packed int32 staging buffer. `assemble_batch` is the device half: it turns
that buffer, once on the device, into positions, slot mapping, seq lens and
block table using only the plan's padded sizes, so the same recorded ops are
right for every live batch of those sizes (a captured graph can run it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from graphattn.keys import BatchShape
from graphattn.state import RequestState, SchedulerOutput
from graphattn.transfer import StagingRing, staging_buffer, to_device

__all__ = ["BatchPlan", "InputBatch", "assemble_batch", "assemble_tensors", "plan_batch",
           "prepare_inputs"]


def _packed_sizes(num_reqs_padded: int, num_tokens_padded: int) -> list[int]:
    """Segment lengths of the packed buffer:
    qsl | slots | scheduled | bound | drafts | shared | req idx | offsets | draft ids.
    qsl first: with a row or more, every later segment starts at 2 or beyond, so a
    dynamic-shape compile of the step, which reads them as views, does not specialize
    their storage offsets for batch 1."""
    r, t = num_reqs_padded, num_tokens_padded
    return [r + 1, r, r, r, r, r, t, t, t]


@dataclass(slots=True)
class BatchPlan:
    """CPU half of one step, padded to (num_reqs_padded, num_tokens_padded).

    Padded request rows have 0 scheduled tokens, bound 0 and slot 0; padded
    tokens have row 0 and offset 0.

    Attributes
    ----------
    num_reqs, num_reqs_padded, num_tokens, num_tokens_padded : int
    packed : torch.Tensor
        int32 CPU [6 * num_reqs_padded + 1 + 3 * num_tokens_padded], pinned
        when the state lives on CUDA: the one buffer copied to the device.
    seq_lens_exact : bool
        True when no draft token of these rows awaits verification, so the
        bound equals the true length.
    req_slots_np, num_scheduled_tokens_np : np.ndarray
        int32 [num_reqs_padded]: state slot and query length per row (views of `packed`).
    query_start_loc_np : np.ndarray
        int32 [num_reqs_padded + 1].
    seq_lens_cpu_upper_bound_np : np.ndarray
        int32 [num_reqs_padded], num_computed_tokens_cpu + num_scheduled_tokens.
    num_draft_tokens_np : np.ndarray
        int32 [num_reqs_padded]: speculative tokens of each row (0 without).
    shared_rows_np : np.ndarray
        int32 [num_reqs_padded]: the shared prefix's tokens for the rows of the group that
        reads it once (`graphattn.cascade`; each such row's first own key), 0 elsewhere.
    req_indices_np, token_offsets_np : np.ndarray
        int32 [num_tokens_padded]: row of each token and its offset in the row's query.
    draft_ids_np : np.ndarray
        int32 [num_tokens_padded]: the draft token id at each draft token, -1 elsewhere.
    query_start_loc_cpu, seq_lens_cpu_upper_bound : torch.Tensor
        int32 CPU views of the arrays above.
    packed_np : np.ndarray
        int32 [packed size]: `packed` as numpy (every array above is a view of it).
    """

    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int
    packed: torch.Tensor
    seq_lens_exact: bool
    req_slots_np: np.ndarray = field(init=False)
    num_scheduled_tokens_np: np.ndarray = field(init=False)
    query_start_loc_np: np.ndarray = field(init=False)
    seq_lens_cpu_upper_bound_np: np.ndarray = field(init=False)
    num_draft_tokens_np: np.ndarray = field(init=False)
    shared_rows_np: np.ndarray = field(init=False)
    req_indices_np: np.ndarray = field(init=False)
    token_offsets_np: np.ndarray = field(init=False)
    draft_ids_np: np.ndarray = field(init=False)
    query_start_loc_cpu: torch.Tensor = field(init=False)
    seq_lens_cpu_upper_bound: torch.Tensor = field(init=False)
    packed_np: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.num_reqs <= self.num_reqs_padded:
            raise ValueError(
                f"num_reqs = {self.num_reqs}, expected in "
                f"[0, num_reqs_padded={self.num_reqs_padded}]"
            )
        if not 0 <= self.num_tokens <= self.num_tokens_padded:
            raise ValueError(
                f"num_tokens = {self.num_tokens}, expected in "
                f"[0, num_tokens_padded={self.num_tokens_padded}]"
            )
        sizes = _packed_sizes(self.num_reqs_padded, self.num_tokens_padded)
        if self.packed.shape != (sum(sizes),) or self.packed.dtype != torch.int32:
            raise ValueError(
                f"packed is {self.packed.dtype} {tuple(self.packed.shape)}, expected "
                f"torch.int32 ({sum(sizes)},)"
            )
        flat, views, at = self.packed.numpy(), [], 0
        self.packed_np = flat
        for n in sizes:  # the segment views, sliced directly (np.split costs more than the rest)
            views.append(flat[at : at + n])
            at += n
        (self.query_start_loc_np, self.req_slots_np, self.num_scheduled_tokens_np,
         self.seq_lens_cpu_upper_bound_np, self.num_draft_tokens_np, self.shared_rows_np,
         self.req_indices_np, self.token_offsets_np, self.draft_ids_np) = views
        self.query_start_loc_cpu = torch.from_numpy(self.query_start_loc_np)
        self.seq_lens_cpu_upper_bound = torch.from_numpy(self.seq_lens_cpu_upper_bound_np)

    @property
    def max_query_len(self) -> int:
        return int(self.num_scheduled_tokens_np.max(initial=0))

    @property
    def max_seq_len(self) -> int:
        """Largest upper-bound length (CPU; never reads the device)."""
        return int(self.seq_lens_cpu_upper_bound_np.max(initial=0))


@dataclass(slots=True)
class InputBatch(BatchPlan):
    """One step's inputs: the CPU plan (see BatchPlan) and its device tensors.

    Attributes
    ----------
    query_start_loc : torch.Tensor
        int32 [num_reqs_padded + 1] on device.
    seq_lens : torch.Tensor
        int32 [num_reqs_padded] on device, true lengths (0 in padded rows).
    positions : torch.Tensor
        int64 [num_tokens_padded] on device (0 for padded tokens).
    slot_mapping : torch.Tensor
        int64 [num_tokens_padded] on device, -1 for padded tokens.
    block_table : torch.Tensor
        int32 [num_reqs_padded, max_num_blocks_per_req] on device (0 in padded rows).
    req_indices : torch.Tensor
        int64 [num_tokens_padded] on device.
    token_slots : torch.Tensor
        int64 [num_tokens_padded] on device: state slot of each token's row.
    req_slots : torch.Tensor
        int64 [num_reqs_padded] on device (0 in padded rows).
    num_scheduled : torch.Tensor
        int32 [num_reqs_padded] on device (0 in padded rows).
    num_drafts : torch.Tensor
        int32 [num_reqs_padded] on device: speculative tokens per row.
    draft_ids : torch.Tensor
        int32 [num_tokens_padded] on device: draft token ids, -1 elsewhere.
    shared_rows : torch.Tensor
        int32 [num_reqs_padded] on device: the shared prefix's tokens for the shared-prefix
        group's rows, 0 elsewhere.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    req_indices: torch.Tensor
    token_slots: torch.Tensor
    req_slots: torch.Tensor
    num_scheduled: torch.Tensor
    num_drafts: torch.Tensor
    draft_ids: torch.Tensor
    shared_rows: torch.Tensor


def plan_batch(
    state: RequestState,
    sched: SchedulerOutput,
    num_reqs_padded: int | None = None,
    num_tokens_padded: int | None = None,
    shape: BatchShape | None = None,
    draft_token_ids: np.ndarray | None = None,
    staging: StagingRing | None = None,
    shared_rows: np.ndarray | None = None,
) -> BatchPlan:
    """CPU half of `prepare_inputs`: validate, pad and pack (numpy, no device work).

    Parameters
    ----------
    state : RequestState
        Request table; not modified.
    sched : SchedulerOutput
        The step's schedule.
    num_reqs_padded, num_tokens_padded : int, optional
        Padded sizes (a graph key's); default: unpadded.
    shape : BatchShape, optional
        ``state.batch_shape(sched)`` when the caller has it already (it holds the
        bound); computed (and the schedule validated) otherwise.
    draft_token_ids : np.ndarray, optional
        int [sum(sched.num_draft_tokens)]: the drafts of every row, rows in batch
        order; row r's drafts are its query tokens 1 .. num_draft_tokens[r].
    staging : StagingRing, optional
        Where the plan comes from: a reused plan of these padded sizes whose packed
        buffer no copy in flight reads (the caller releases it, keyed by
        ``(num_reqs_padded, num_tokens_padded)``, once its copy is enqueued, and drops
        it then); default a fresh plan and pinned buffer.
    shared_rows : np.ndarray, optional
        int [num_reqs]: the shared prefix's tokens for the rows that read it once
        (`graphattn.cascade.plan_shared_prefix`), 0 for the others.

    Raises
    ------
    ValueError
        If a padded size is below the real size, or the schedule is invalid
        for `state`.
    """
    if shape is None:
        shape = state.batch_shape(sched)
    reqs_p, toks_p = _padded_sizes(shape, num_reqs_padded, num_tokens_padded)
    _check_draft_ids(sched, draft_token_ids)

    def make() -> BatchPlan:
        size = sum(_packed_sizes(reqs_p, toks_p))
        return BatchPlan(0, reqs_p, 0, toks_p, staging_buffer(size, torch.int32, state.device),
                         True)

    plan = make() if staging is None else staging.take((reqs_p, toks_p), make)
    plan.num_reqs, plan.num_tokens = shape.num_reqs, shape.num_tokens
    pending = state.num_pending_drafts_np  # the whole table first: no gather without drafts
    plan.seq_lens_exact = not (pending.any() and pending[sched.req_slots].any())
    _fill_plan(plan, sched, shape, draft_token_ids)
    if shared_rows is not None:
        plan.shared_rows_np[: plan.num_reqs] = shared_rows
    return plan


def _padded_sizes(shape: BatchShape, num_reqs_padded: int | None,
                  num_tokens_padded: int | None) -> tuple[int, int]:
    reqs_p = shape.num_reqs if num_reqs_padded is None else num_reqs_padded
    toks_p = shape.num_tokens if num_tokens_padded is None else num_tokens_padded
    if reqs_p < shape.num_reqs:
        raise ValueError(f"num_reqs_padded = {reqs_p} is below num_reqs = {shape.num_reqs}")
    if toks_p < shape.num_tokens:
        raise ValueError(f"num_tokens_padded = {toks_p} is below num_tokens = "
                         f"{shape.num_tokens}")
    return reqs_p, toks_p


def _check_draft_ids(sched: SchedulerOutput, draft_token_ids: np.ndarray | None) -> None:
    drafts = sched.num_draft_tokens
    if drafts is not None:
        want = int(drafts.sum())
        got = 0 if draft_token_ids is None else int(np.asarray(draft_token_ids).shape[0])
        if draft_token_ids is not None and got != want:
            raise ValueError(f"draft_token_ids has {got} entries, expected sum(num_draft_tokens)"
                             f" = {want}")
    elif draft_token_ids is not None and len(draft_token_ids):
        raise ValueError("draft_token_ids given but sched.num_draft_tokens is None")


def _fill_plan(plan: BatchPlan, sched: SchedulerOutput, shape: BatchShape,
               draft_token_ids: np.ndarray | None) -> None:
    """Write the schedule into the plan's packed buffer (vectorized, no per-row loop)."""
    num_reqs, num_tokens, toks_p = plan.num_reqs, plan.num_tokens, plan.num_tokens_padded
    flat = plan.packed_np
    flat[: flat.shape[0] - toks_p] = 0
    plan.draft_ids_np[:] = -1
    plan.req_slots_np[:num_reqs] = sched.req_slots
    plan.num_scheduled_tokens_np[:num_reqs] = sched.num_scheduled_tokens
    plan.seq_lens_cpu_upper_bound_np[:num_reqs] = shape.seq_lens_upper_bound
    qsl = plan.query_start_loc_np
    req_idx = plan.req_indices_np[:num_tokens]
    if num_tokens == num_reqs:  # one token per row: row t, offset 0 (no cumsum)
        qsl[: num_reqs + 1] = np.arange(num_reqs + 1, dtype=np.int32)
        qsl[num_reqs + 1 :] = num_reqs
        req_idx[:] = qsl[:num_tokens]
    else:
        plan.num_scheduled_tokens_np.cumsum(out=qsl[1:])
        req_idx[:] = np.repeat(np.arange(num_reqs, dtype=np.int32), sched.num_scheduled_tokens)
        np.subtract(np.arange(num_tokens, dtype=np.int32), qsl[req_idx],
                    out=plan.token_offsets_np[:num_tokens])
    drafts = sched.num_draft_tokens
    if drafts is not None:
        plan.num_draft_tokens_np[:num_reqs] = drafts
        if draft_token_ids is not None and drafts.any():
            off = plan.token_offsets_np[:num_tokens]
            is_draft = (off >= 1) & (off <= drafts[req_idx])
            plan.draft_ids_np[:num_tokens][is_draft] = draft_token_ids


def assemble_tensors(packed: torch.Tensor, num_computed_tokens: torch.Tensor,
                     state_block_table: torch.Tensor, num_reqs_padded: int,
                     num_tokens_padded: int, block_size: int) -> tuple[torch.Tensor, ...]:
    """The device tensors of `assemble_batch` from plain tensors and ints (capturable and
    compilable: `GraphRunner(compile=True)` compiles it once per padded shape).

    Returns
    -------
    (query_start_loc, seq_lens, positions, slot_mapping, block_table, req_indices,
    token_slots, req_slots, num_scheduled, num_drafts, draft_ids, shared_rows); see
    InputBatch.
    """
    reqs_p, toks_p = num_reqs_padded, num_tokens_padded
    (d_qsl, d_slots, d_sched, _, d_drafts, d_shared, d_req_idx, d_offsets,
     d_draft_ids) = torch.split(packed, _packed_sizes(reqs_p, toks_p))
    d_slots = d_slots.long()
    d_req_idx = d_req_idx.long()
    real_row = d_sched > 0
    real_tok = torch.arange(toks_p, device=packed.device) < d_qsl[-1]
    computed = num_computed_tokens[d_slots]
    seq_lens = torch.where(real_row, computed + d_sched, 0)
    if reqs_p == 0:  # padded tokens with no row at all: nothing to gather
        token_slots = torch.zeros_like(d_req_idx)
        positions = torch.zeros(toks_p, dtype=torch.int64, device=packed.device)
        slot_mapping = torch.full((toks_p,), -1, dtype=torch.int64, device=packed.device)
    else:
        token_slots = d_slots[d_req_idx]
        positions = torch.where(real_tok, computed[d_req_idx] + d_offsets, 0).long()
        max_blocks = state_block_table.shape[1]
        block_idx = torch.clamp(positions // block_size, max=max_blocks - 1)
        blocks = state_block_table[token_slots, block_idx].long()
        slot_mapping = torch.where(real_tok, blocks * block_size + positions % block_size, -1)
    block_table = torch.where(real_row[:, None], state_block_table[d_slots], 0)
    return (d_qsl, seq_lens, positions, slot_mapping, block_table, d_req_idx, token_slots,
            d_slots, d_sched, d_drafts, d_draft_ids, d_shared)


def assemble_batch(state: RequestState, plan: BatchPlan, packed: torch.Tensor,
                   tensors_fn: Callable[..., tuple[torch.Tensor, ...]] = assemble_tensors,
                   ) -> InputBatch:
    """Device half of `prepare_inputs` (capturable): the InputBatch of `plan`.

    Reads `plan`'s padded sizes only, never its live counts: padded rows are
    the rows with 0 scheduled tokens and padded tokens those past the last
    query_start_loc entry, both found on the device. So the ops recorded for
    a dummy plan are right for every live plan of the same padded sizes.
    Positions and slots come from the true computed counts on the device, so
    they stay right while the CPU bound over-estimates.

    Parameters
    ----------
    state : RequestState
        Its device tensors (computed counts, block table) are read.
    plan : BatchPlan
        Gives the padded sizes and the CPU fields of the result.
    packed : torch.Tensor
        int32 [plan.packed.shape[0]] on `state.device`: a packed buffer of
        those sizes (this plan's, or a live one's in a captured graph).
    tensors_fn : callable
        `assemble_tensors`, or a compiled version of it.
    """
    (qsl, seq_lens, positions, slot_mapping, block_table, req_idx, token_slots, req_slots,
     sched, drafts, draft_ids, shared) = tensors_fn(
        packed, state.num_computed_tokens, state.block_table, plan.num_reqs_padded,
        plan.num_tokens_padded, state.block_size)
    return InputBatch(plan.num_reqs, plan.num_reqs_padded, plan.num_tokens,
                      plan.num_tokens_padded, plan.packed, plan.seq_lens_exact,
                      query_start_loc=qsl, seq_lens=seq_lens, positions=positions,
                      slot_mapping=slot_mapping, block_table=block_table, req_indices=req_idx,
                      token_slots=token_slots, req_slots=req_slots, num_scheduled=sched,
                      num_drafts=drafts, draft_ids=draft_ids, shared_rows=shared)


def prepare_inputs(
    state: RequestState,
    sched: SchedulerOutput,
    num_reqs_padded: int | None = None,
    num_tokens_padded: int | None = None,
) -> InputBatch:
    """Build the padded InputBatch of one step: `plan_batch` then `assemble_batch`.

    Every number that decides a shape comes from CPU arrays; the device
    receives one packed host-to-device copy and computes the rest. Parameters
    and errors: see `plan_batch`.
    """
    plan = plan_batch(state, sched, num_reqs_padded, num_tokens_padded)
    return assemble_batch(state, plan, to_device(plan.packed, state.device))
