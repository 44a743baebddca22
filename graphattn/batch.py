"""prepare_inputs: scheduler output -> padded InputBatch (CPU numbers + device tensors)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from graphattn.state import RequestState, SchedulerOutput
from graphattn.transfer import to_device

__all__ = ["InputBatch", "prepare_inputs"]


@dataclass(slots=True)
class InputBatch:
    """One step's inputs, padded to (num_reqs_padded, num_tokens_padded).

    Padded request rows have 0 scheduled tokens, bound 0, seq len 0 and block
    table row 0; padded tokens have position 0 and slot -1.

    Attributes
    ----------
    req_slots_np : np.ndarray
        int32 [num_reqs_padded], state slot per row (0 in padded rows).
    num_scheduled_tokens_np : np.ndarray
        int32 [num_reqs_padded], query length per row.
    query_start_loc_np : np.ndarray
        int32 [num_reqs_padded + 1].
    seq_lens_cpu_upper_bound_np : np.ndarray
        int32 [num_reqs_padded], num_computed_tokens_cpu + num_scheduled_tokens.
    req_indices_np : np.ndarray
        int32 [num_tokens_padded], row of each token (0 for padded tokens).
    seq_lens_exact : bool
        True when no draft token of these rows awaits verification, so the
        bound equals the true length.
    query_start_loc_cpu, seq_lens_cpu_upper_bound : torch.Tensor
        int32 CPU views of the arrays above.
    query_start_loc : torch.Tensor
        int32 [num_reqs_padded + 1] on device.
    seq_lens : torch.Tensor
        int32 [num_reqs_padded] on device, true lengths (0 in padded rows).
    positions : torch.Tensor
        int64 [num_tokens_padded] on device.
    slot_mapping : torch.Tensor
        int64 [num_tokens_padded] on device, -1 for padded tokens.
    block_table : torch.Tensor
        int32 [num_reqs_padded, max_num_blocks_per_req] on device.
    req_indices : torch.Tensor
        int64 [num_tokens_padded] on device.
    token_slots : torch.Tensor
        int64 [num_tokens_padded] on device: state slot of each token's row.
    req_slots, num_scheduled : torch.Tensor
        int32 [num_reqs] on device (unpadded), for `RequestState.postprocess`.
    """

    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int
    req_slots_np: np.ndarray
    num_scheduled_tokens_np: np.ndarray
    query_start_loc_np: np.ndarray
    seq_lens_cpu_upper_bound_np: np.ndarray
    req_indices_np: np.ndarray
    seq_lens_exact: bool
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu_upper_bound: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    req_indices: torch.Tensor
    token_slots: torch.Tensor
    req_slots: torch.Tensor
    num_scheduled: torch.Tensor

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
        if self.query_start_loc_np.shape != (self.num_reqs_padded + 1,):
            raise ValueError(
                f"query_start_loc_np has shape {self.query_start_loc_np.shape}, "
                f"expected ({self.num_reqs_padded + 1},)"
            )

    @property
    def max_query_len(self) -> int:
        return int(self.num_scheduled_tokens_np.max(initial=0))

    @property
    def max_seq_len(self) -> int:
        """Largest upper-bound length (CPU; never reads the device)."""
        return int(self.seq_lens_cpu_upper_bound_np.max(initial=0))


def prepare_inputs(
    state: RequestState,
    sched: SchedulerOutput,
    num_reqs_padded: int | None = None,
    num_tokens_padded: int | None = None,
) -> InputBatch:
    """Build the padded InputBatch of one step.

    Every number that decides a shape comes from CPU arrays; the device only
    receives one packed host-to-device copy and gathers from the true computed
    counts, so positions and slots stay right while the CPU bound over-estimates.

    Parameters
    ----------
    state : RequestState
        Request table; not modified.
    sched : SchedulerOutput
        The step's schedule.
    num_reqs_padded, num_tokens_padded : int, optional
        Padded sizes (a graph key's); default: unpadded.

    Returns
    -------
    InputBatch

    Raises
    ------
    ValueError
        If a padded size is below the real size, or the schedule is invalid
        for `state`.
    """
    state.check_schedule(sched)
    num_reqs = sched.num_reqs
    num_tokens = sched.total_num_scheduled_tokens
    reqs_p = num_reqs if num_reqs_padded is None else num_reqs_padded
    toks_p = num_tokens if num_tokens_padded is None else num_tokens_padded
    if reqs_p < num_reqs:
        raise ValueError(f"num_reqs_padded = {reqs_p} is below num_reqs = {num_reqs}")
    if toks_p < num_tokens:
        raise ValueError(f"num_tokens_padded = {toks_p} is below num_tokens = {num_tokens}")

    # One int32 staging buffer: slots | scheduled | qsl | bound | req_indices | offsets.
    packed = np.zeros(4 * reqs_p + 1 + 2 * toks_p, dtype=np.int32)
    views = np.split(packed, np.cumsum([reqs_p, reqs_p, reqs_p + 1, reqs_p, toks_p]))
    slots_np, sched_np, qsl_np, bound_np, req_idx_np, offsets_np = views
    slots_np[:num_reqs] = sched.req_slots
    sched_np[:num_reqs] = sched.num_scheduled_tokens
    np.cumsum(sched_np, out=qsl_np[1:])
    np.add(state.num_computed_tokens_np[sched.req_slots], sched.num_scheduled_tokens,
           out=bound_np[:num_reqs])
    req_idx_np[:num_tokens] = np.repeat(np.arange(num_reqs, dtype=np.int32),
                                        sched.num_scheduled_tokens)
    offsets_np[:num_tokens] = (np.arange(num_tokens, dtype=np.int32)
                               - qsl_np[req_idx_np[:num_tokens]])

    dev = to_device(packed, state.device)
    d_slots, d_sched, d_qsl, _, d_req_idx, d_offsets = torch.split(
        dev, [reqs_p, reqs_p, reqs_p + 1, reqs_p, toks_p, toks_p]
    )
    d_slots = d_slots.long()
    d_req_idx = d_req_idx.long()
    token_slots = d_slots[d_req_idx] if reqs_p else torch.zeros_like(d_req_idx)
    computed = state.num_computed_tokens[d_slots]
    seq_lens = computed + d_sched
    seq_lens[num_reqs:].fill_(0)
    if reqs_p == 0:  # padded tokens with no row at all: nothing to gather
        positions = torch.zeros(toks_p, dtype=torch.int64, device=state.device)
        slot_mapping = torch.full((toks_p,), -1, dtype=torch.int64, device=state.device)
    else:
        positions = (computed[d_req_idx] + d_offsets).long()
        positions[num_tokens:].fill_(0)
        bs = state.block_size
        block_idx = torch.clamp(positions // bs, max=state.max_num_blocks_per_req - 1)
        blocks = state.block_table[token_slots, block_idx].long()
        slot_mapping = blocks * bs + positions % bs
        slot_mapping[num_tokens:].fill_(-1)
    block_table = state.block_table[d_slots]
    block_table[num_reqs:].fill_(0)

    pending = state.num_pending_drafts_np[sched.req_slots]
    return InputBatch(
        num_reqs=num_reqs,
        num_reqs_padded=reqs_p,
        num_tokens=num_tokens,
        num_tokens_padded=toks_p,
        req_slots_np=slots_np,
        num_scheduled_tokens_np=sched_np,
        query_start_loc_np=qsl_np,
        seq_lens_cpu_upper_bound_np=bound_np,
        req_indices_np=req_idx_np,
        seq_lens_exact=not pending.any(),
        query_start_loc_cpu=torch.from_numpy(qsl_np),
        seq_lens_cpu_upper_bound=torch.from_numpy(bound_np),
        query_start_loc=d_qsl,
        seq_lens=seq_lens,
        positions=positions,
        slot_mapping=slot_mapping,
        block_table=block_table,
        req_indices=d_req_idx,
        token_slots=token_slots,
        req_slots=d_slots[:num_reqs],
        num_scheduled=d_sched[:num_reqs],
    )
