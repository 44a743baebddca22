"""Draft/verify steps: keep the CPU bound >= the true length, correct it on CPU.

After a verify step the mirror has been advanced by all scheduled tokens, the
drafts included (the optimistic bound). The true count is advanced on the
device by scheduled minus rejected. When the rejected counts reach the CPU
(an async copy of the sampler output, one or more steps later),
`apply_rejections` subtracts them from the mirror.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphattn.checks import INT32_MAX, as_int32_array, is_integer_tensor
from graphattn.state import RequestState, SchedulerOutput

__all__ = ["FeedbackResult", "RejectionFeedback", "apply_rejections", "check_drafts",
           "verify_schedule"]


@dataclass(slots=True)
class RejectionFeedback:
    """Verification results of one earlier step, as CPU numbers.

    Parameters
    ----------
    req_slots : np.ndarray
        int32 [n], slots of the verified requests.
    num_draft_tokens : np.ndarray
        int32 [n], drafts each request had in that step.
    num_rejected_tokens : np.ndarray
        int32 [n], drafts the verifier rejected, 0..num_draft_tokens.
    generations : np.ndarray, optional
        int64 [n], `RequestState.generation_np` of each row when the step ran.
    step : int, optional
        The step's id (`RequestState.num_steps` before it advanced). With
        `generations`, feedback is checked row by row (`apply_rejections`).
    origin : int, optional
        `RequestState.uid` of the state the step ran on (feedback of another state
        is refused). `RejectionFeedback.of_step` fills all three.
    """

    req_slots: np.ndarray
    num_draft_tokens: np.ndarray
    num_rejected_tokens: np.ndarray
    generations: np.ndarray | None = None
    step: int | None = None
    origin: int | None = None

    def __post_init__(self) -> None:
        self.req_slots = as_int32_array("req_slots", self.req_slots, 0)
        self.num_draft_tokens = as_int32_array("num_draft_tokens", self.num_draft_tokens, 0)
        self.num_rejected_tokens = as_int32_array("num_rejected_tokens", self.num_rejected_tokens,
                                                  0)
        n = self.req_slots.shape[0]
        if (self.generations is None) != (self.step is None):
            raise ValueError("generations and step go together (see RejectionFeedback.of_step)")
        if self.generations is not None:
            self.generations = np.array(self.generations, dtype=np.int64, copy=True)
        for name in ("num_draft_tokens", "num_rejected_tokens", "generations"):
            arr = getattr(self, name)
            if arr is not None and arr.shape != (n,):
                raise ValueError(f"{name} has {arr.shape[0]} entries, expected {n}")
        bad = (self.num_rejected_tokens < 0) | (self.num_rejected_tokens > self.num_draft_tokens)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"num_rejected_tokens[{i}] = {self.num_rejected_tokens[i]}, expected in "
                f"[0, num_draft_tokens={self.num_draft_tokens[i]}]"
            )


    @classmethod
    def of_step(cls, state: RequestState, sched: SchedulerOutput,
                num_rejected_tokens: np.ndarray) -> RejectionFeedback:
        """Feedback of the step `sched` that just advanced `state` (call right after it)."""
        if sched.num_draft_tokens is None:
            raise ValueError("sched has no num_draft_tokens: nothing to verify")
        return cls(sched.req_slots, sched.num_draft_tokens, num_rejected_tokens,
                   state.generation_np[sched.req_slots], state.num_steps - 1, state.uid)


@dataclass(frozen=True, slots=True)
class FeedbackResult:
    """What `apply_rejections` did with each row.

    Attributes
    ----------
    applied : np.ndarray
        bool [n]: rows whose rejections corrected the mirror.
    stale : np.ndarray
        bool [n]: refused, the slot now holds another request (or none).
    duplicate : np.ndarray
        bool [n]: refused, this step's feedback was applied already, or the step awaits
        none (`RequestState.resync` counted it), or drafts beyond those awaiting
        verification.
    """

    applied: np.ndarray
    stale: np.ndarray
    duplicate: np.ndarray


def verify_schedule(state: RequestState, req_slots: np.ndarray, num_draft_tokens: np.ndarray,
                    ) -> SchedulerOutput:
    """Schedule of a verify step: each request runs 1 + its drafts.

    Parameters
    ----------
    state : RequestState
    req_slots : np.ndarray
        int32 [n].
    num_draft_tokens : np.ndarray
        int32 [n], >= 0.
    """
    drafts = as_int32_array("num_draft_tokens", num_draft_tokens, 0, 1 << 16)
    sched = SchedulerOutput(req_slots, drafts + 1, drafts)
    state.check_schedule(sched)
    return sched


def apply_rejections(state: RequestState, feedback: RejectionFeedback) -> FeedbackResult:
    """Correct the CPU mirror with rejected counts that reached the CPU.

    mirror -= num_rejected; the bound stays >= the true length, and equals it
    once every step's feedback has been applied.

    Feedback with generations and a step id (`RejectionFeedback.of_step`) is
    checked row by row: a row of a request that finished or was preempted
    (another generation in the slot) is refused as stale, a row of a step whose
    feedback was applied already (or that awaits none) as a duplicate, and the live
    rows are applied. Steps' feedback applies in any order, each once. Feedback
    without them must be exact for every row, or it is refused whole. Applied
    whole or not at all, even when interrupted.

    Raises
    ------
    ValueError
        Feedback of another state; feedback without generations naming a free
        slot, or more drafts than await verification (applied twice, or another
        request's).
    """
    if feedback.origin is not None and feedback.origin != state.uid:
        raise ValueError(f"feedback of the state with uid {feedback.origin}, applied to the "
                         f"state with uid {state.uid}: a step's output goes back to the "
                         "runner that ran it")
    slots = feedback.req_slots
    none = np.zeros(slots.shape[0], dtype=bool)
    if slots.shape[0] == 0:
        return FeedbackResult(none, none, none)
    if (slots >= state.max_num_reqs).any():
        raise ValueError(f"req_slots must be in [0, {state.max_num_reqs}), got {slots.tolist()}")
    over = feedback.num_draft_tokens > state.num_pending_drafts_np[slots]
    if feedback.generations is None:
        _check_exact(state, slots, feedback.num_draft_tokens, over)
        ok, stale, dup = ~none, none, none
    else:
        stale = ~state.active_np[slots] | (state.generation_np[slots] != feedback.generations)
        dup = ~stale & (over | (feedback.step not in state.awaiting_feedback))
        ok = ~stale & ~dup
    _correct(state, slots[ok], feedback.num_draft_tokens[ok],
             feedback.num_rejected_tokens[ok], feedback.step)
    return FeedbackResult(ok, stale, dup)


def _check_exact(state: RequestState, slots: np.ndarray, drafts: np.ndarray,
                 over: np.ndarray) -> None:
    if not state.active_np[slots].all():
        raise ValueError(f"req_slots {slots[~state.active_np[slots]].tolist()} hold no request")
    if over.any():
        i = int(np.argmax(over))
        raise ValueError(f"slot {slots[i]}: feedback for {drafts[i]} drafts, but only "
                         f"{state.num_pending_drafts_np[slots[i]]} await verification")


def _correct(state: RequestState, slots: np.ndarray, drafts: np.ndarray, rejected: np.ndarray,
             step: int | None) -> None:
    """The mirror's correction, undone if interrupted part-way."""
    saved = (state.num_pending_drafts_np[slots], state.num_computed_tokens_np[slots],
             step in state.awaiting_feedback)
    try:
        state.awaiting_feedback.discard(step)
        state.num_pending_drafts_np[slots] -= drafts
        state.num_computed_tokens_np[slots] -= rejected
        state.prune_feedback()
    except BaseException:
        state.num_pending_drafts_np[slots], state.num_computed_tokens_np[slots] = saved[:2]
        if saved[2]:
            state.awaiting_feedback.add(step)
        raise


def check_drafts(state: RequestState, sched: SchedulerOutput, draft_token_ids: Any,
                 decode_query_len: int, vocab_size: int | None,
                 has_proposer: bool) -> np.ndarray | torch.Tensor | None:
    """A step's drafts, validated on the CPU before anything changes.

    Parameters
    ----------
    state : RequestState
    sched : SchedulerOutput
    draft_token_ids : sequence of int, np.ndarray, torch.Tensor or None
        Host ids of every row's drafts flattened in batch order, or an integer tensor
        [num_reqs, decode_query_len - 1] on any device (read on the device only), or None
        (the proposer drafts inside the step).
    decode_query_len : int
        The runner's 1 + drafts per decode row.
    vocab_size : int, optional
        Host ids must lie in [0, vocab_size).
    has_proposer : bool

    Returns
    -------
    np.ndarray or torch.Tensor or None
        int32 host ids, the device tensor as given, or None (no drafts, or the proposer's).
    """
    if sched.num_draft_tokens is None or not sched.num_draft_tokens.any():
        if draft_token_ids is not None and len(draft_token_ids):
            raise ValueError("draft_token_ids given but the schedule has no num_draft_tokens")
        return None
    if decode_query_len < 2:
        raise ValueError("drafts need a runner whose policy has decode_query_len > 1")
    if draft_token_ids is None and not has_proposer:
        raise ValueError("sched.num_draft_tokens > 0 needs draft_token_ids (or a runner "
                         "built with a proposer)")
    most = decode_query_len - 1
    if sched.num_draft_tokens.max() > most:
        raise ValueError(f"num_draft_tokens up to {sched.num_draft_tokens.max()}, expected "
                         f"<= decode_query_len - 1 = {most}")
    with_drafts = sched.num_draft_tokens > 0
    slots = sched.req_slots
    pre = state.num_computed_tokens_np[slots] < state.num_prompt_tokens_np[slots]
    if (with_drafts & pre).any():
        raise ValueError(f"slots {slots[with_drafts & pre].tolist()} have drafts before their "
                         "prompt is computed")
    if draft_token_ids is None:
        return None
    if isinstance(draft_token_ids, torch.Tensor) and (
            draft_token_ids.device.type != "cpu" or draft_token_ids.dim() == 2):
        return _check_draft_tensor(draft_token_ids, (sched.num_reqs, most), has_proposer)
    hi = vocab_size - 1 if vocab_size else INT32_MAX
    return as_int32_array("draft_token_ids", draft_token_ids, 0, hi)


def _check_draft_tensor(drafts: torch.Tensor, want: tuple[int, int],
                        has_proposer: bool) -> torch.Tensor:
    if has_proposer:
        raise ValueError("draft_token_ids as a device tensor needs a runner without a "
                         "proposer (its proposer drafts rows given no host ids)")
    if tuple(drafts.shape) != want or not is_integer_tensor(drafts):
        raise ValueError(f"draft_token_ids as a tensor on {drafts.device} must be integer of "
                         f"shape {want} (rows, decode_query_len - 1), got {drafts.dtype} "
                         f"{tuple(drafts.shape)}")
    return drafts
