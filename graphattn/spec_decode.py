"""Draft/verify steps: keep the CPU bound >= the true length, correct it on CPU.

After a verify step the mirror has been advanced by all scheduled tokens, the
drafts included (the optimistic bound). The true count is advanced on the
device by scheduled minus rejected. When the rejected counts reach the CPU
(an async copy of the sampler output, one or more steps later),
`apply_rejections` subtracts them from the mirror.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from graphattn.state import RequestState, SchedulerOutput, _as_int_array

__all__ = ["RejectionFeedback", "apply_rejections", "verify_schedule"]


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
    """

    req_slots: np.ndarray
    num_draft_tokens: np.ndarray
    num_rejected_tokens: np.ndarray

    def __post_init__(self) -> None:
        self.req_slots = _as_int_array("req_slots", self.req_slots)
        self.num_draft_tokens = _as_int_array("num_draft_tokens", self.num_draft_tokens)
        self.num_rejected_tokens = _as_int_array("num_rejected_tokens", self.num_rejected_tokens)
        n = self.req_slots.shape[0]
        for name in ("num_draft_tokens", "num_rejected_tokens"):
            if getattr(self, name).shape[0] != n:
                raise ValueError(f"{name} has {getattr(self, name).shape[0]} entries, expected {n}")
        bad = (self.num_rejected_tokens < 0) | (self.num_rejected_tokens > self.num_draft_tokens)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"num_rejected_tokens[{i}] = {self.num_rejected_tokens[i]}, expected in "
                f"[0, num_draft_tokens={self.num_draft_tokens[i]}]"
            )


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
    drafts = _as_int_array("num_draft_tokens", num_draft_tokens)
    if drafts.size and drafts.min() < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got min {drafts.min()}")
    sched = SchedulerOutput(req_slots, drafts + 1, drafts)
    state.check_schedule(sched)
    return sched


def apply_rejections(state: RequestState, feedback: RejectionFeedback) -> None:
    """Correct the CPU mirror with rejected counts that reached the CPU.

    mirror -= num_rejected; the bound stays >= the true length, and equals it
    once every step's feedback has been applied.

    Raises
    ------
    ValueError
        If a request has fewer unverified drafts than the feedback names (the
        feedback was applied twice, or belongs to another request).
    """
    slots = feedback.req_slots
    if slots.size == 0:
        return
    if not state.active_np[slots].all():
        raise ValueError(f"req_slots {slots[~state.active_np[slots]].tolist()} hold no request")
    pending = state.num_pending_drafts_np[slots]
    over = feedback.num_draft_tokens > pending
    if over.any():
        i = int(np.argmax(over))
        raise ValueError(
            f"slot {slots[i]}: feedback for {feedback.num_draft_tokens[i]} drafts, but only "
            f"{pending[i]} await verification"
        )
    state.num_pending_drafts_np[slots] -= feedback.num_draft_tokens
    state.num_computed_tokens_np[slots] -= feedback.num_rejected_tokens
