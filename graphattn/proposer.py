"""Draft proposers that run inside the step (capturable: fixed shapes, no host reads).

A proposer reads the runner's device token buffer and returns each row's drafts; the
runner verifies them in the same step, so speculative decoding needs no host round trip
for the draft ids. The schedule still says how many drafts each row gets (a CPU number).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from graphattn.checks import as_index

__all__ = ["DraftProposer", "NgramProposer"]


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
