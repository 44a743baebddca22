"""Draft proposers that run inside the step (capturable: fixed shapes, no host reads).

A proposer reads the runner's device token buffer and returns each row's drafts; the
runner verifies them in the same step, so speculative decoding needs no host round trip
for the draft ids. The schedule still says how many drafts each row gets (a CPU number).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from graphattn.checks import as_index

if TYPE_CHECKING:
    from graphattn.backends.registry import BuilderContext
    from graphattn.batch import InputBatch
    from graphattn.keys import GraphKey
    from graphattn.metadata import CommonAttentionMetadata
    from graphattn.sampling import SamplingTable
    from graphattn.state import RequestState

__all__ = ["DraftProposer", "NgramProposer", "StepDrafter"]


@runtime_checkable
class DraftProposer(Protocol):
    """Proposes drafts on the device from the tokens known so far."""

    def propose(self, token_ids: torch.Tensor, req_slots: torch.Tensor,
                last_positions: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """Drafts per row.

        Parameters
        ----------
        token_ids : int64 [max_num_reqs, max_model_len + 1]
            The runner's token buffer: prompt and generated tokens by position.
        req_slots : int64 [rows]
        last_positions : int64 [rows]
            Position of each row's last known token (the one the step feeds first).
        num_drafts : int
            Drafts to return per row (a CPU number: decode_query_len - 1).

        Returns
        -------
        torch.Tensor
            int64 [rows, num_drafts] token ids.
        """
        ...


@runtime_checkable
class StepDrafter(DraftProposer, Protocol):
    """A proposer that sees every step (a draft model with its own KV cache): it follows
    the target through each step's tokens and drafts the next step's tokens at its end.

    The runner calls `bind` once, `plan` on the CPU before each step's device work, and
    `observe` inside it after the target's tokens are sampled; `propose` then returns the
    drafts made at the end of the row's previous step.

    Attributes
    ----------
    draft_probs : torch.Tensor or None
        float32 [max_num_reqs + 1, k, vocab]: the distribution each draft was drawn from
        (None: drafts are point masses), for rejection sampling of sampled rows.
    reads_hidden_states : bool
        The drafter reads the target's hidden states (an EAGLE-style head): the runner
        sets the target's ``keep_hidden_states`` and passes them to `observe`.
    """

    draft_probs: torch.Tensor | None
    reads_hidden_states: bool

    def bind(self, state: RequestState, context: BuilderContext,
             sampler: SamplingTable | None) -> None:
        """Allocate per-slot buffers for `state` (once, before any step)."""
        ...

    def plan(self, batch: InputBatch, common: CommonAttentionMetadata,
             key: GraphKey | None) -> Any:
        """The draft passes' metadata from CPU numbers (and the batch's device tensors)."""
        ...

    def observe(self, plan: Any, input_ids: torch.Tensor, batch: InputBatch,
                sampled: torch.Tensor, new_lens: torch.Tensor, done: torch.Tensor,
                hidden: torch.Tensor | None = None) -> None:
        """Device work after sampling (capturable): follow the step's tokens and draft.

        Parameters
        ----------
        plan : the step's `plan`
        input_ids : int64 [num_tokens_padded], the step's tokens (drafts included)
        batch : InputBatch
        sampled : int64 [rows], each row's new token
        new_lens : int64 [rows], each row's true length after the step (the new token's
            position)
        done : bool [rows], rows whose new token is real (prompt complete, not padding)
        hidden : [num_tokens_padded, hidden] or None, the target's hidden states (for
            drafters with ``reads_hidden_states``)
        """
        ...


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """Prompt-lookup decoding: the tokens that followed the latest earlier occurrence of the
    row's last `n` tokens, within the last `window` positions (the last token repeated when
    none occurs; verification rejects what is wrong).

    Parameters
    ----------
    n : int
        Length of the matched suffix.
    window : int
        History searched per row (cost: rows x window x n compares per step).
    """

    n: int = 3
    window: int = 256

    def __post_init__(self) -> None:
        as_index("NgramProposer.n", self.n, 1)
        as_index("NgramProposer.window", self.window, 2)
        if not 1 <= self.n < self.window:
            raise ValueError(f"NgramProposer needs 1 <= n < window, got n = {self.n}, window = "
                             f"{self.window}")

    def propose(self, token_ids: torch.Tensor, req_slots: torch.Tensor,
                last_positions: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """See `DraftProposer.propose`."""
        n, w = self.n, self.window
        dev = token_ids.device
        idx = last_positions.long()[:, None] - (w - 1) + torch.arange(w, device=dev)
        valid = idx >= 0
        hist = token_ids[req_slots.long()[:, None], idx.clamp(min=0)]
        tail = hist[:, w - n:]
        # window s covers positions s .. s + n - 1 of the history; the last one is the tail
        same = (hist.unfold(1, n, 1) == tail[:, None, :]).all(-1)[:, :-1] & valid[:, : w - n]
        ends = torch.arange(n - 1, w - 1, device=dev)
        best = torch.where(same, ends, -1).amax(-1, keepdim=True)  # [rows, 1], -1: none
        take = (best + 1 + torch.arange(num_drafts, device=dev)).clamp(0, w - 1)
        return torch.where(best >= 0, hist.gather(1, take), tail[:, -1:])
