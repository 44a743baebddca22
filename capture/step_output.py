"""What one runner step returns (`StepOutput`), and the rings that bring it to the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from graphattn.keys import CUDAGraphMode, GraphKey
from graphattn.spec_decode import RejectionFeedback
from graphattn.state import RequestState, SchedulerOutput
from graphattn.transfer import OutputRing, TokenFuture

__all__ = ["OutputRings", "StepOutput"]


@dataclass(slots=True)
class StepOutput:
    """One step's result.

    The device tensors of a replayed step (`logits`, `sampled`, `logprobs`,
    `num_rejected`) are views of graph memory, valid until the next step: a later
    replay writes over them (every key's logits share one scratch; a key's other
    outputs are overwritten by its next replay). ``.clone()`` what must outlive the
    step; the host futures (`sampled_host`, `emitted_host`) are copies already.

    Attributes
    ----------
    logits : torch.Tensor
        [num_reqs, vocab] at each request's last scheduled token.
    sampled : torch.Tensor
        int64 [num_reqs] sampled tokens (greedy unless the request's
        SamplingParams say otherwise), already written to the token buffer.
    sampled_host : TokenFuture
        The same tokens on their way to the host: ``wait()`` returns them as
        np.ndarray int64 [num_reqs], blocking on this step's event only.
    logprobs : torch.Tensor or None
        float32 [num_reqs] log-probabilities of `sampled` (runners built with
        ``sampling=True``).
    num_rejected : torch.Tensor or None
        int32 [num_reqs] drafts the verification rejected (steps with drafts).
    feedback : RejectionFeedback or None
        Slots, drafts, generations and step id of a step with drafts, waiting
        for its rejected counts: `GraphRunner.apply_feedback(out)` fills them
        from the device (blocking on this step only) and corrects the mirror.
    key : GraphKey or None
        The key whose padded shapes the step ran at; None when it ran eager at
        its own shapes (no key fits, or force_eager).
    replayed : bool
        A captured graph of `key` replayed (False: the key had none and the
        runner's on_missing="eager" ran it eagerly at the key's shapes).
    host_seconds : float
        Host time of step() (the device may still be running).
    mode : CUDAGraphMode
        How the step ran: FULL (a whole-step graph replayed), PIECEWISE (the
        pieces of the split model replayed around eager attention) or NONE (eager).
    emitted_host : TokenFuture or None
        Steps with drafts: ``wait()`` gives int64 [num_reqs, decode_query_len], the
        tokens each row produced in order (its accepted drafts, then `sampled`),
        -1 past them: what a serving loop streams, whoever proposed the drafts.
    """

    logits: torch.Tensor
    sampled: torch.Tensor
    key: GraphKey | None
    replayed: bool
    host_seconds: float
    sampled_host: TokenFuture | None = None
    logprobs: torch.Tensor | None = None
    num_rejected: torch.Tensor | None = None
    rejected_host: TokenFuture | None = None
    feedback: RejectionFeedback | None = None
    mode: CUDAGraphMode = CUDAGraphMode.NONE
    emitted_host: TokenFuture | None = None


class OutputRings:
    """The host copies of a step's tokens, rejected counts and emitted tokens.

    Parameters
    ----------
    max_num_reqs : int
    device : torch.device
    decode_query_len : int
        Columns of the emitted tokens.
    overlap : bool
        Copy to the host on one side stream (CUDA) instead of the current stream.
    """

    def __init__(self, max_num_reqs: int, device: torch.device, decode_query_len: int,
                 overlap: bool) -> None:
        download = torch.cuda.Stream(device) if overlap else None
        self.sampled = OutputRing(max_num_reqs, device, stream=download)
        self.rejected = OutputRing(max_num_reqs, device, stream=download)
        self.emitted = OutputRing(max_num_reqs, device, decode_query_len, download)

    def of_step(self, state: RequestState, sched: SchedulerOutput,
                outs: tuple[torch.Tensor | None, ...], key: GraphKey | None,
                mode: CUDAGraphMode, current: Any, logprobs: bool) -> StepOutput:
        """The step's `StepOutput`, its host copies started (`current`: the current stream;
        `outs`: the device step's logits, sampled, logprobs, rejected, emitted)."""
        out = StepOutput(outs[0], outs[1], key, mode == CUDAGraphMode.FULL, 0.0,
                         self.sampled.push(outs[1], current), outs[2] if logprobs else None,
                         mode=mode)
        if sched.num_draft_tokens is not None:
            out.num_rejected = outs[3]
            out.rejected_host = self.rejected.push(outs[3], current)
            out.emitted_host = self.emitted.push(outs[4], current)
            # rejected counts are filled in by apply_feedback once they reach the host
            out.feedback = RejectionFeedback.of_step(state, sched,
                                                     np.zeros(sched.num_reqs, np.int32))
        return out
