"""Draft-model speculative decoding inside the step, from CPU bounds only.

`DraftModelProposer` runs a small model (any forward with the target's interface: a
2-layer `TinyDecoder`, a wrapped HF model) on its own paged KV cache, laid out like the
target's: the same block ids and slots, so admission, prefix sharing, preemption and resume
need nothing of their own. Each step, inside the target's graph:

1. *follow*: the draft model runs the step's tokens (drafts included) with the target's
   common metadata, so its cache holds every position the target's does;
2. *draft*: k single-token passes from each row's new token, at positions
   ``new_len .. new_len + k - 1`` (device values), with metadata planned from the CPU bound
   ``seq_lens_cpu_upper_bound + k``; the drafts wait by slot for the row's next step.

Positions past the true length hold draft KV of unverified tokens. They are never read as
valid: the next step's follow pass rewrites every position from the new true length on
before any pass reads it. A position past the request's blocks drafts from the sink
(only acceptance suffers): allocate k lookahead slots per request for exact drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from graphattn.backends.registry import BuilderContext
from graphattn.batch import InputBatch
from graphattn.capture.model_contract import (
    backend_of,
    check_caches,
    check_slots,
    model_dtype,
    vocab_size_of,
)
from graphattn.config import INPUT_NAMES
from graphattn.keys import GraphKey
from graphattn.metadata import CommonAttentionMetadata
from graphattn.proposer import DraftProposer
from graphattn.sampling import DRAFT_SALT, SamplingTable, greedy_tokens
from graphattn.state import RequestState

__all__ = ["DraftModelProposer", "DraftPlan", "StepDrafter"]


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
class _PassBuffers:
    """Device tensors of the single-token draft passes of `rows` rows (filled per pass)."""

    query_start_loc: torch.Tensor  # int32 [rows + 1]
    query_start_loc_cpu: torch.Tensor
    positions: torch.Tensor  # int64 [rows]
    seq_lens: torch.Tensor  # int32 [rows]
    slot_mapping: torch.Tensor  # int64 [rows]
    logits_indices: torch.Tensor  # int64 [rows]


@dataclass(frozen=True, slots=True)
class DraftPlan:
    """One step's draft metadata (CPU-planned; `GraphRunner` builds it before the device work).

    Attributes
    ----------
    follow : object
        The draft builder's metadata of the step's own tokens.
    passes : object
        The draft builder's metadata of one token per row, bound + k, key-fixed.
    rows : int
        Rows drafted (the step's padded rows, at most max_num_reqs).
    buffers : _PassBuffers
    """

    follow: Any
    passes: Any
    rows: int
    buffers: _PassBuffers


class DraftModelProposer:
    """Drafts with a small model inside the target's step (see the module docstring).

    Parameters
    ----------
    model : ModelForward
        ``model(inputs, attn_metadata) -> logits``, the target's vocabulary, its paged caches
        allocated for the target state's blocks (``model.allocate_caches(blocks, block_size)``).
    backend : str, optional
        The draft model's attention backend; default its first ``backends`` entry, else
        "paged".

    Attributes
    ----------
    drafts : torch.Tensor
        int64 [max_num_reqs + 1, k]: each slot's drafts for its next step (the last row takes
        the writes of rows that draft nothing).
    draft_probs : torch.Tensor or None
        float32 [max_num_reqs + 1, k, vocab]: the distribution each draft was drawn from
        (runners that sample), for rejection sampling.
    """

    def __init__(self, model: Any, backend: str | None = None) -> None:
        self.model, self.backend = model, backend
        self.draft_probs: torch.Tensor | None = None
        self.drafts: torch.Tensor | None = None
        self._buffers: dict[int, _PassBuffers] = {}

    def bind(self, state: RequestState, context: BuilderContext,
             sampler: SamplingTable | None) -> None:
        """Check the draft model against `state` and allocate the per-slot buffers."""
        self.k = context.decode_query_len - 1
        if self.k < 1:
            raise ValueError("DraftModelProposer needs a runner whose policy has "
                             f"decode_query_len > 1, got {context.decode_query_len}")
        check_slots(self.model, state)
        if getattr(self.model, "caches", None) == []:
            raise ValueError(f"the draft model {type(self.model).__name__} has no caches: call "
                             "its allocate_caches(num_blocks, block_size) for the target "
                             "state's blocks first")
        check_caches(self.model, state)
        _, spec = backend_of(self.model, self.backend)
        self.builder = spec.make_builder(context)
        self.state, self.sampler = state, sampler
        self.names = tuple(getattr(self.model, "static_input_names", INPUT_NAMES[:2]))
        self.vocab_size = vocab_size_of(self.model)
        dev, n = state.device, state.max_num_reqs + 1
        self.drafts = torch.zeros(n, self.k, dtype=torch.int64, device=dev)
        self.hidden = None
        if self.reads_hidden_states:
            size = getattr(self.model, "hidden_size", None)
            if not isinstance(size, int):
                raise ValueError(f"the draft head {type(self.model).__name__} reads "
                                 "hidden_states but has no int hidden_size")
            self.hidden = torch.zeros(n, size, dtype=model_dtype(self.model), device=dev)
        if sampler is not None:
            if self.vocab_size is None:
                raise ValueError(f"a sampling runner needs the draft model's vocab_size "
                                 f"({type(self.model).__name__} has no cfg or config with one)")
            self.draft_probs = torch.zeros(n, self.k, self.vocab_size, device=dev)

    @property
    def reads_hidden_states(self) -> bool:
        """An EAGLE-style head: it reads the target's hidden states ("hidden_states")."""
        return "hidden_states" in getattr(self.model, "static_input_names", ())

    def propose(self, token_ids: torch.Tensor, req_slots: torch.Tensor,
                last_positions: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """The drafts made at the end of each row's previous step (see `DraftProposer`)."""
        if self.drafts is None:  # probed before bind: the shape of what a step returns
            return torch.zeros(req_slots.shape[0], num_drafts, dtype=torch.int64,
                               device=req_slots.device)
        return self.drafts[req_slots.long(), :num_drafts]

    def plan(self, batch: InputBatch, common: CommonAttentionMetadata,
             key: GraphKey | None) -> DraftPlan | None:
        """The follow pass's metadata (the target's common metadata) and the draft passes'
        (one token per row; CPU bound = the step's bound + k; the key's bucket + k)."""
        rows = min(batch.num_reqs_padded, self.state.max_num_reqs)
        if rows == 0:
            return None
        follow = self.builder.build(common, key)
        buf = self._buffers.get(rows) or self._make_buffers(rows)
        bound = torch.from_numpy(batch.seq_lens_cpu_upper_bound_np[:rows] + np.int32(self.k))
        top = int(bound.max())
        bucket = (key.max_len_bucket if key is not None else top) + self.k
        one = CommonAttentionMetadata(
            query_start_loc=buf.query_start_loc, query_start_loc_cpu=buf.query_start_loc_cpu,
            seq_lens=buf.seq_lens, seq_lens_cpu_upper_bound=bound, num_reqs=rows,
            num_actual_tokens=rows, max_query_len=1, max_seq_len=top,
            block_table_tensor=batch.block_table[:rows], slot_mapping=buf.slot_mapping)
        passes = self.builder.build(one, GraphKey(rows, rows, bucket, True))
        return DraftPlan(follow, passes, rows, buf)

    def _make_buffers(self, rows: int) -> _PassBuffers:
        dev = self.state.device
        qsl = torch.arange(rows + 1, dtype=torch.int32)
        buf = _PassBuffers(qsl.to(dev), qsl,
                           torch.zeros(rows, dtype=torch.int64, device=dev),
                           torch.ones(rows, dtype=torch.int32, device=dev),
                           torch.full((rows,), -1, dtype=torch.int64, device=dev),
                           torch.arange(rows, device=dev))
        self._buffers[rows] = buf
        return buf

    def observe(self, plan: DraftPlan | None, input_ids: torch.Tensor, batch: InputBatch,
                sampled: torch.Tensor, new_lens: torch.Tensor, done: torch.Tensor,
                hidden: torch.Tensor | None = None) -> None:
        """Follow the step's tokens, then draft k tokens per row (capturable). `hidden`:
        the target's hidden states [T, hidden] (heads that read them)."""
        if plan is None:
            return
        r, st, buf = plan.rows, self.state, plan.buffers
        qsl = batch.query_start_loc.long()
        slots = batch.req_slots[:r]
        inputs = {"input_ids": input_ids, "positions": batch.positions,
                  "req_slots": batch.req_slots, "logits_indices": (qsl[1 : r + 1] - 1).clamp(min=0)}
        if self.hidden is not None:
            inputs["hidden_states"] = self._previous_hidden(batch, hidden)
            # the target's state at each row's last verified token, for its next step
            at = (qsl[1 : r + 1] - 1 - (batch.seq_lens[:r] - new_lens[:r])).clamp(min=0)
            last = hidden[at]
            self.hidden[torch.where(batch.num_scheduled[:r] > 0, slots, st.max_num_reqs)] = last
        self._forward(inputs, plan.follow)
        base, live = new_lens[:r].long(), done[:r]
        target = torch.where(live, slots, st.max_num_reqs)  # rows drafting nothing: spare
        token = sampled[:r]
        for i in range(self.k):
            pos = base + i
            ok = live & (pos < st.max_model_len)
            pos = pos.clamp(max=st.max_model_len - 1)
            block = batch.block_table[:r].gather(1, (pos // st.block_size)[:, None]).squeeze(1)
            buf.positions.copy_(pos)
            buf.seq_lens.copy_(pos + 1)
            buf.slot_mapping.copy_(torch.where(ok, block.long() * st.block_size
                                               + pos % st.block_size, -1))
            inputs = {"input_ids": token, "positions": buf.positions, "req_slots": slots,
                      "logits_indices": buf.logits_indices}
            if self.hidden is not None:
                inputs["hidden_states"] = last if i == 0 else self.model.last_hidden_states
            logits = self._forward(inputs, plan.passes)
            token = self._pick(logits, slots, pos + 1, target, i)
            self.drafts[target, i] = token

    def _previous_hidden(self, batch: InputBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The target's state one position behind each token: the step's own for all but a
        row's first token, which takes the row's kept state (zeros at position 0)."""
        t = hidden.shape[0]
        shifted = torch.cat([hidden.new_zeros(1, hidden.shape[1]), hidden[:-1]])
        first = torch.arange(t, device=hidden.device) == batch.query_start_loc.long()[
            batch.req_indices]
        kept = torch.where((batch.positions > 0)[:, None],
                           self.hidden[batch.token_slots].to(hidden.dtype), 0)
        return torch.where(first[:, None], kept, shifted)

    def _forward(self, inputs: dict[str, torch.Tensor], meta: Any) -> torch.Tensor:
        logits = self.model({n: inputs[n] for n in self.names}, meta)
        if "logits_indices" in self.names:
            return logits
        return logits[inputs["logits_indices"]]

    def _pick(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
              target: torch.Tensor, i: int) -> torch.Tensor:
        """Greedy rows: the argmax; sampled rows: a draw from the row's sampling distribution
        (kept in `draft_probs` for the verifier)."""
        if self.sampler is None:
            return greedy_tokens(logits)
        probs = self.sampler.probs(logits, slots)
        self.draft_probs[target, i] = probs
        return self.sampler.draw(probs, slots, positions, DRAFT_SALT)
