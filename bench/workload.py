"""A synthetic scheduler: requests join and leave, prompts are chunk-prefilled,
decodes may carry speculative drafts whose rejections reach the CPU late.

It drives the tests and `bench.soak`; it also keeps the *true*
computed counts on CPU (`true_computed`) so tests can check the bound.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from graphattn.spec_decode import RejectionFeedback, apply_rejections
from graphattn.state import RequestState, SchedulerOutput
from graphattn.transfer import to_device

__all__ = ["SyntheticScheduler", "WorkloadConfig", "device_truth"]


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Knobs of the synthetic workload.

    Parameters
    ----------
    prompt_len : tuple[int, int]
        Inclusive range of prompt lengths.
    max_new_tokens : tuple[int, int]
        Inclusive range of generated tokens per request.
    token_budget : int
        Max tokens scheduled per step (chunked prefill beyond it).
    num_spec_tokens : int
        Drafts per decode step (0: no speculative decoding).
    feedback_delay : int
        Steps until rejected counts reach the CPU: 1 = before the next step is
        scheduled (bound exact), 2 = one step late (async scheduling), ...
    arrival_prob : float
        Chance per step that a new request joins while a slot is free.
    """

    prompt_len: tuple[int, int] = (4, 48)
    max_new_tokens: tuple[int, int] = (4, 24)
    token_budget: int = 64
    num_spec_tokens: int = 0
    feedback_delay: int = 1
    arrival_prob: float = 0.7

    def __post_init__(self) -> None:
        for name in ("prompt_len", "max_new_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} = {(lo, hi)}, expected 1 <= low <= high")
        if self.token_budget < 1:
            raise ValueError(f"token_budget = {self.token_budget}, expected >= 1")
        if self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens = {self.num_spec_tokens}, expected >= 0")
        if self.feedback_delay < 1:
            raise ValueError(f"feedback_delay = {self.feedback_delay}, expected >= 1")


class SyntheticScheduler:
    """Random schedules over a RequestState (slot s owns blocks s*B..s*B+B-1)."""

    def __init__(self, state: RequestState, config: WorkloadConfig, seed: int = 0) -> None:
        self.state = state
        self.config = config
        self.rng = np.random.default_rng(seed)
        n = state.max_num_reqs
        self.true_computed = np.zeros(n, dtype=np.int64)
        self.target_len = np.zeros(n, dtype=np.int64)
        self._next_id = 0
        self._feedback: deque[tuple[int, RejectionFeedback]] = deque()
        self.step_index = 0
        hi = config.prompt_len[1] + config.max_new_tokens[1] + config.num_spec_tokens
        if hi > state.max_model_len:
            raise ValueError(f"workload needs max_model_len >= {hi}, got {state.max_model_len}")

    @property
    def num_blocks(self) -> int:
        """KV blocks the workload addresses (plus one sink block for padded slots)."""
        return self.state.max_num_reqs * self.state.max_num_blocks_per_req + 1

    def _admit(self) -> None:
        st, cfg = self.state, self.config
        while st.num_active < st.max_num_reqs and self.rng.random() < cfg.arrival_prob:
            prompt = int(self.rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1))
            new = int(self.rng.integers(cfg.max_new_tokens[0], cfg.max_new_tokens[1] + 1))
            free = int(np.flatnonzero(~st.active_np)[0])
            b = st.max_num_blocks_per_req
            slot = st.add_request(f"r{self._next_id}", prompt, np.arange(free * b, free * b + b))
            self._next_id += 1
            self.true_computed[slot] = 0
            self.target_len[slot] = prompt + new

    def _retire(self) -> None:
        st = self.state
        done = st.active_np & (self.true_computed >= self.target_len)
        pending = {int(s) for _, fb in self._feedback for s in fb.req_slots}
        for req_id, slot in list(st.req_id_to_slot.items()):
            if done[slot] and slot not in pending:
                st.remove_request(req_id)

    def deliver_feedback(self, force: bool = False) -> None:
        """Apply rejection feedback that is due (all of it with `force`)."""
        while self._feedback and (force or self._feedback[0][0] <= self.step_index):
            apply_rejections(self.state, self._feedback.popleft()[1])

    def next_schedule(self) -> SchedulerOutput:
        """Retire, admit, and schedule the next step (may be empty)."""
        self.deliver_feedback()
        self._retire()
        self._admit()
        st, cfg = self.state, self.config
        runnable = st.active_np & (self.true_computed < self.target_len)
        runnable &= st.num_computed_tokens_np < st.max_model_len  # else: awaits feedback
        slots = np.flatnonzero(runnable)
        slots = slots[self.rng.permutation(slots.size)].astype(np.int32)
        prompt = st.num_prompt_tokens_np[slots]
        bound = st.num_computed_tokens_np[slots]
        in_prefill = bound < prompt
        # Decodes first, as a real scheduler reorders them.
        order = np.argsort(in_prefill, kind="stable")
        slots, prompt, bound = slots[order], prompt[order], bound[order]
        in_prefill = in_prefill[order]
        want = np.where(in_prefill, prompt - bound, 1)
        drafts = np.zeros_like(want)
        if cfg.num_spec_tokens:
            room = st.max_model_len - bound - 1
            drafts = np.where(in_prefill, 0, np.minimum(cfg.num_spec_tokens, room))
        want = want + drafts
        # Greedy token budget: decodes always fit first, prefills get chunked.
        ends = np.cumsum(want)
        budget = max(cfg.token_budget, int(np.sum(want[~in_prefill])))
        take = np.clip(budget - (ends - want), 0, want)
        keep = take > 0
        return SchedulerOutput(
            slots[keep], take[keep], drafts[keep] if cfg.num_spec_tokens else None
        )

    def finish_step(self, sched: SchedulerOutput) -> np.ndarray:
        """Advance state after the step ran: sample rejections, postprocess.

        Returns
        -------
        np.ndarray
            int32 [num_reqs] rejected drafts per request (0 without drafts).
        """
        st = self.state
        rejected = np.zeros(sched.num_reqs, dtype=np.int32)
        if sched.num_draft_tokens is not None and sched.num_reqs:
            rejected = self.rng.integers(0, sched.num_draft_tokens + 1).astype(np.int32)
        st.postprocess(
            sched,
            num_rejected=None if sched.num_draft_tokens is None
            else to_device(rejected, st.device),
        )
        self.true_computed[sched.req_slots] += sched.num_scheduled_tokens - rejected
        if sched.num_draft_tokens is not None and sched.num_reqs:
            fb = RejectionFeedback(sched.req_slots, sched.num_draft_tokens, rejected)
            self._feedback.append((self.step_index + self.config.feedback_delay, fb))
        self.step_index += 1
        return rejected

    def true_seq_lens(self, sched: SchedulerOutput) -> np.ndarray:
        """int64 [num_reqs] true lengths (context + query) of a schedule, before it runs."""
        return self.true_computed[sched.req_slots] + sched.num_scheduled_tokens


def device_truth(state: RequestState) -> np.ndarray:
    """Test helper: read the device's true computed counts (a host sync)."""
    return state.num_computed_tokens.to(torch.int64).cpu().numpy()
