"""The device side of a runner step, from its packed buffer (capturable).

Prepare's device half, the metadata build (a key fixes the plan), the forward, sampling,
speculative verification, token write-back and the device truth's advance: one function
that `graphattn.capture.graphs` captures per key, and inductor compiles per batch shape
(whole, or only the forward's repeated blocks: `CompileConfig.regions`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from graphattn.artifacts import ArtifactStore
from graphattn.backends import AttentionBuilder, BuilderContext
from graphattn.batch import BatchPlan, InputBatch, assemble_batch, assemble_tensors
from graphattn.capture.drafter import StepDrafter
from graphattn.capture.model_contract import same_device
from graphattn.capture.piecewise import PiecewiseCompiler
from graphattn.capture.profiling import StageProfiler
from graphattn.checks import is_integer_tensor
from graphattn.compile import BucketCompiler, pin_triton_cache, repeated_blocks
from graphattn.config import CompileConfig
from graphattn.keys import GraphKey
from graphattn.metadata import build_common_metadata
from graphattn.proposer import DraftProposer
from graphattn.sampling import (
    ACCEPT_SALT,
    RESIDUAL_SALT,
    SamplingTable,
    greedy_tokens,
    rejection_sample,
)
from graphattn.state import RequestState

__all__ = ["DeviceStep", "ModelForward", "StepTensors"]

# forward(inputs, attn_metadata) -> logits [num_tokens, vocab], or [rows, vocab] at the token
# rows inputs["logits_indices"] for a forward that reads them
ModelForward = Callable[[dict[str, torch.Tensor], Any], torch.Tensor]
# logits, sampled, logprobs (or None), rejected, emitted: see DeviceStep.__call__
StepTensors = tuple[torch.Tensor | None, ...]


class _CompiledBlock:
    """A block's forward through the shared compiler, set on the block while a compiled step
    runs. Pickles as None: a saved compiled block records the block it was traced with,
    never the compiled code."""

    __slots__ = ("block", "compiler")

    def __init__(self, compiler: BucketCompiler, block: torch.nn.Module) -> None:
        self.compiler, self.block = compiler, block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiler(self.block, *args, **kwargs)

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return type(None), ()


class DeviceStep:
    """Everything a step does on the device, and the device buffers it owns.

    Parameters
    ----------
    forward : ModelForward
    state : RequestState
    builder : AttentionBuilder
    decode_query_len : int
        1 + drafts per decode row (the dispatcher's).
    static_input_names : sequence of str
        What `forward` reads from its `inputs`.
    compile : CompileConfig
    vocab_size : int, optional
        Drafts at or past it count as rejected.
    sampler : SamplingTable, optional
        Per-slot sampling parameters (None: greedy, no logprobs).
    proposer : DraftProposer, optional
        Drafts inside the step for rows given none. A `StepDrafter` (a draft model) is
        bound to the state here and follows every step.
    context : BuilderContext, optional
        What a `StepDrafter` builds its metadata with (the runner's).
    piecewise : PiecewiseCompiler, optional
        The split forward of piecewise keys.
    profiler : StageProfiler

    Attributes
    ----------
    token_ids : torch.Tensor
        int64 [max_num_reqs, max_model_len + 1]: each slot's prompt and sampled tokens;
        the spare last column takes the writes of padded rows and unfinished prefills.
    prompt_lens : torch.Tensor
        int32 [max_num_reqs].
    slot_drafts : torch.Tensor
        int64 [max_num_reqs, max(decode_query_len - 1, 1)]: drafts given as a device
        tensor, waiting by slot until the step reads them.
    advanced : bool
        The step's work may have advanced the device truth: set right before the advance
        (the runner then keeps the step in the mirror, so the mirror stays >= the truth).
    """

    def __init__(self, forward: ModelForward, state: RequestState, builder: AttentionBuilder,
                 decode_query_len: int, static_input_names: Sequence[str],
                 compile: CompileConfig, vocab_size: int | None,
                 sampler: SamplingTable | None, proposer: DraftProposer | None,
                 piecewise: PiecewiseCompiler | None, profiler: StageProfiler,
                 context: BuilderContext | None = None) -> None:
        self.forward, self.state, self.builder = forward, state, builder
        self.decode_query_len = decode_query_len
        self.static_input_names = tuple(static_input_names)
        self.vocab_size, self.sampler, self.proposer = vocab_size, sampler, proposer
        self.piecewise, self.profiler = piecewise, profiler
        self.compiler = self.assembler = None
        self.blocks: list[torch.nn.Module] = []
        if (compile.enabled and compile.backend == "inductor") or piecewise is not None:
            pin_triton_cache(state.device)
        if compile.enabled:
            inductor = compile.backend == "inductor"
            kw = dict(backend=compile.backend, max_compiles=compile.max_compiles,
                      fullgraph=compile.fullgraph, dynamic=compile.dynamic,
                      options=compile.inductor_options() if inductor else None)
            size_options = {n: compile.inductor_options(n) for n in compile.size_options}
            if compile.regions == "blocks":
                self.blocks = repeated_blocks(forward)
            # blocks: one compile of their class's forward, shared, called unbound
            fn = type(self.blocks[0]).forward if self.blocks else self._run_compiled
            self.compiler = BucketCompiler(
                fn, **kw, size_options=size_options, static_roots=(self,),
                artifacts=self._store(compile, "blocks" if self.blocks else "step", kw,
                                      size_options))
            self.assembler = BucketCompiler(assemble_tensors, **kw, static_roots=(state,),
                                            artifacts=self._store(compile, "assembler", kw))
        self.advanced = False
        dev = state.device
        self.slot_drafts = torch.full((state.max_num_reqs, max(decode_query_len - 1, 1)), -1,
                                      dtype=torch.int64, device=dev)
        self.token_ids = torch.zeros(state.max_num_reqs, state.max_model_len + 1,
                                     dtype=torch.int64, device=dev)
        self.prompt_lens = torch.zeros(state.max_num_reqs, dtype=torch.int32, device=dev)
        self.drafter = proposer if isinstance(proposer, StepDrafter) else None
        if self.drafter is not None:
            if context is None:
                raise ValueError("a StepDrafter proposer needs the runner's BuilderContext")
            self.drafter.bind(state, context, sampler)
            _check_vocab(self.drafter, vocab_size)
            if self.drafter.reads_hidden_states:
                if not hasattr(forward, "keep_hidden_states"):
                    raise ValueError(f"the draft head reads the target's hidden states, but "
                                     f"{type(forward).__name__} has no keep_hidden_states")
                forward.keep_hidden_states = True
        if proposer is not None and decode_query_len > 1:  # refused now, not at a step
            one = torch.zeros(1, dtype=torch.int32, device=dev)
            _check_proposed(proposer, proposer.propose(self.token_ids, one, one,
                                                       decode_query_len - 1),
                            (1, decode_query_len - 1), dev)

    def _store(self, compile: CompileConfig, name: str,
               *settings: object) -> ArtifactStore | None:
        """Where `name`'s compiled functions are kept (None without an artifact_dir); its
        fingerprint: the compile settings but the number of compile workers, and what the
        traced code depends on besides its guards (the forward's, builder's, sampler's,
        proposer's and blocks' types, the query width, the forward's inputs)."""
        if compile.artifact_dir is None:
            return None
        parts = [type(o).__module__ + "." + type(o).__qualname__ for o in (
            self.forward, self.builder, self.sampler, self.proposer, *self.blocks[:1])]
        fingerprint = repr((_code_settings(settings), parts, self.decode_query_len,
                            self.static_input_names))
        return ArtifactStore(compile.artifact_dir, name, fingerprint)

    def __getstate__(self) -> dict[str, Any]:
        """What pickling keeps: a saved compiled step records the objects its guards read,
        which never include the compilers (compiled code), piecewise forward or profiler."""
        skip = ("compiler", "assembler", "piecewise", "profiler")
        return {k: (None if k in skip else v) for k, v in self.__dict__.items()}

    def compilers(self) -> list[BucketCompiler]:
        """The compilers of this step (none unless compiled)."""
        return [c for c in (self.compiler, self.assembler) if c is not None]

    def __call__(self, packed: torch.Tensor, plan: BatchPlan, key: GraphKey | None,
                 piecewise: bool = False) -> StepTensors:
        """Run the step on the device (capturable).

        Only `plan`'s padded sizes shape the recorded work, so one capture serves every
        live batch of its key; padded rows write into the spare column and advance by 0.
        Verification (keys whose rows may carry drafts): the target's token at every query
        position is sampled; a row accepts its drafts up to the first one that differs from
        the target's token there (greedy match, or sample-and-match for sampled rows:
        exact rejection sampling for a draft given as a token), its output is the target's
        token after the accepted drafts, and its truth advances by 1 + accepted.
        `piecewise`: the forward runs as the split pieces around eager attention.

        Returns
        -------
        logits : [num_reqs_padded, vocab] at each row's output position;
        sampled : int64 [num_reqs_padded]; logprobs : float32 [num_reqs_padded] (None
        without a sampler); rejected : int32 [num_reqs_padded];
        emitted : int64 [num_reqs_padded, decode_query_len] (`StepOutput.emitted_host`)
        """
        compiled = self.compiler is not None and key is not None and not piecewise
        batch = assemble_batch(self.state, plan, packed,
                               self.assembler if compiled else assemble_tensors)
        with self.profiler.range("build", key):
            common = build_common_metadata(batch)
            meta = self.builder.build(common, key)
            draft = None if self.drafter is None else self.drafter.plan(batch, common, key)
        spec = self.decode_query_len > 1 and (
            key is None or not key.uniform_decode or key.query_len > 1)
        # one token per row, row r's at index r: the logits need no gather (a forward that
        # takes logits_indices gathers its hidden rows anyway: no flag, so decode and mixed
        # keys share one compiled step)
        single = (key is not None and key.uniform_decode
                  and key.num_tokens_padded == key.num_reqs_padded
                  and "logits_indices" not in self.static_input_names)
        if compiled:  # compiled code may advance the truth at any point of its run
            self.advanced = True
            with self.compiler.at_size(key.num_tokens_padded):
                if self.blocks:
                    with self._compiled_blocks():
                        return self._run_compiled(batch, meta, spec, single, draft)
                return self.compiler(batch, meta, spec, single, draft)
        return self._run(batch, meta, spec, single, self.piecewise if piecewise else self.forward,
                         draft)

    @contextlib.contextmanager
    def _compiled_blocks(self) -> Iterator[None]:
        """Block in which each of `blocks` runs its forward through the shared compiler,
        whose call settings (static marks included) are entered once for all of them;
        outside it the model is as it was given."""
        for b in self.blocks:
            b.forward = _CompiledBlock(self.compiler, b)
        try:
            with self.compiler.calls():
                yield
        finally:
            for b in self.blocks:
                del b.forward

    def _run_compiled(self, batch: InputBatch, meta: Any, spec: bool,
                      single: bool, draft: Any) -> StepTensors:
        return self._run(batch, meta, spec, single, self.forward, draft)

    def _run(self, batch: InputBatch, meta: Any, spec: bool, single: bool,
             forward: Callable[..., torch.Tensor], draft: Any = None) -> StepTensors:
        """Token ids in, forward, sampling or verification, write-back and the truth's
        advance (pure device work). `single`: every row has one token, row r's at index r,
        so the logits are the forward's own rows (no gather). A forward that reads
        "logits_indices" computes logits at those rows only (each row's last token, or
        every token when drafts are verified)."""
        ids = self.token_ids[batch.token_slots, batch.positions]
        if spec:  # each token's row and offset in it, shared by drafting and verification
            offsets = self._offsets(batch, ids.shape[0])
            ids, proposed = self._with_drafts(batch, ids, offsets)
        # a plain step needs logits at each row's last token only, and at most max_num_reqs
        # rows are real: later (padded) rows take no part after the forward
        rows = min(batch.req_slots.shape[0], self.state.max_num_reqs)
        at = (torch.arange(ids.shape[0], device=ids.device) if spec or single
              else (batch.query_start_loc[1 : rows + 1].long() - 1).clamp(min=0))
        inputs = {"input_ids": ids, "positions": batch.positions, "req_slots": batch.req_slots,
                  "logits_indices": at}
        logits = forward({n: inputs[n] for n in self.static_input_names}, meta)
        if spec:  # logits at every token either way
            return self._finish(batch, *self._verify(batch, ids, logits, offsets, proposed),
                                spec, ids, draft)
        gathered = single or "logits_indices" in self.static_input_names
        logits = (logits if gathered else logits[at])[:rows]
        slots = batch.req_slots[:rows]
        sampled, logprobs = self._sample(logits, slots, batch.seq_lens[:rows].long())
        width = self.decode_query_len
        emitted = sampled[:, None] if width == 1 else torch.cat(
            [sampled[:, None], sampled.new_full((rows, width - 1), -1)], 1)
        # no row of a plain step carries drafts (num_drafts is 0 throughout), so none is
        # rejected: the input itself, not a fill launched per step
        return self._finish(batch, logits, sampled, logprobs, batch.num_drafts[:rows], emitted,
                            spec, ids, draft)

    def _finish(self, batch: InputBatch, logits: torch.Tensor, sampled: torch.Tensor,
                logprobs: torch.Tensor | None, rejected: torch.Tensor, emitted: torch.Tensor,
                spec: bool, ids: torch.Tensor, draft: Any) -> StepTensors:
        """Write each finished row's token back, advance the truth (its first
        ``sampled.shape[0]`` rows: the rest are padding) and let a draft model follow."""
        rows, st = sampled.shape[0], self.state
        slots, scheduled = batch.req_slots[:rows], batch.num_scheduled[:rows]
        seq = batch.seq_lens[:rows].long() - (rejected if spec else 0)
        done = (scheduled > 0) & (seq >= self.prompt_lens[slots])
        col = torch.where(done, seq, st.max_model_len).clamp(max=st.max_model_len)
        self.token_ids[slots, col] = sampled
        if not torch.compiler.is_compiling():
            self.advanced = True  # from here on the step counts (the mirror keeps it)
        st.advance_device(slots, scheduled, rejected if spec else None)
        if self.drafter is not None:
            hidden = (self.forward.last_hidden_states if self.drafter.reads_hidden_states
                      else None)
            self.drafter.observe(draft, ids, batch, sampled, seq, done, hidden)
        return logits, sampled, logprobs, rejected, emitted

    def _offsets(self, batch: InputBatch, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's row and offset in it."""
        rows = batch.req_indices
        return rows, torch.arange(t, device=batch.positions.device) - batch.query_start_loc.long(
        )[rows]

    def _with_drafts(self, batch: InputBatch, ids: torch.Tensor,
                     offsets: tuple[torch.Tensor, torch.Tensor],
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`ids` with each row's drafts in place: the host's (in the packed buffer), else
        the proposer's, else those a device tensor left in `slot_drafts` (ids outside the
        vocabulary count as no draft); drafts are written to the token buffer. Also returns
        bool [T]: the tokens whose draft the proposer made."""
        t, k = ids.shape[0], self.decode_query_len - 1
        rows, offset = offsets
        drafts = batch.draft_ids.long()
        if self.proposer is not None:
            qsl = batch.query_start_loc.long()
            last = batch.positions[qsl[:-1].clamp(max=max(t - 1, 0))]
            source = self.proposer.propose(self.token_ids, batch.req_slots, last, k)
            _check_proposed(self.proposer, source, (batch.req_slots.shape[0], k), ids.device)
        else:
            source = self.slot_drafts[batch.req_slots]
        wanted = (offset >= 1) & (offset <= batch.num_drafts.long()[rows]) & (drafts < 0)
        drafts = torch.where(wanted, source[rows, (offset - 1).clamp(0, k - 1)], drafts)
        if self.vocab_size:
            drafts = torch.where(drafts < self.vocab_size, drafts, -1)
        is_draft = drafts >= 0
        ids = torch.where(is_draft, drafts, ids)
        col = torch.where(is_draft, batch.positions, self.state.max_model_len)
        self.token_ids[batch.token_slots, col] = ids  # non-draft tokens: the spare column
        return ids, wanted & is_draft & (self.proposer is not None)

    def _verify(self, batch: InputBatch, ids: torch.Tensor, logits_all: torch.Tensor,
                offsets: tuple[torch.Tensor, torch.Tensor],
                proposed: torch.Tensor) -> StepTensors:
        """Accept each row's drafts up to the first the target disagrees with."""
        t, width = ids.shape[0], self.decode_query_len
        rows, offset = offsets
        qsl = batch.query_start_loc.long()
        num_drafts = batch.num_drafts.long()
        nxt = torch.cat([ids[1:], ids.new_full((1,), -1)])
        checked = offset < num_drafts[rows]  # the next token is a draft of this row
        target, lp_all = self._sample(logits_all, batch.token_slots, batch.positions + 1)
        probs = getattr(self.drafter, "draft_probs", None)
        if probs is not None and self.sampler is not None:
            target, lp_all = self._rejection_sample(
                batch, logits_all, target, nxt, checked,
                torch.cat([proposed[1:], proposed.new_zeros(1)]), offset, probs)
        bad = checked & (target != nxt)
        first_bad = torch.full_like(num_drafts, t).scatter_reduce(
            0, rows, torch.where(bad, offset, t), "amin")
        accepted = torch.minimum(first_bad, num_drafts)
        rejected = (num_drafts - accepted).to(torch.int32)
        # a row's output follows its accepted drafts: its last token minus the rejected
        out_idx = (qsl[1:] - 1 - rejected).clamp(min=0)
        logprobs = None if lp_all is None else lp_all[out_idx]
        # a row emits its accepted drafts (equal to the target there), then `sampled`
        j = torch.arange(width, device=ids.device)
        at = (qsl[:-1, None] + batch.num_scheduled.long()[:, None] - 1
              - num_drafts[:, None] + j).clamp(0, max(t - 1, 0))
        emitted = torch.where(j <= accepted[:, None], target[at], -1)
        return logits_all[out_idx], target[out_idx], logprobs, rejected, emitted

    def _rejection_sample(self, batch: InputBatch, logits: torch.Tensor, target: torch.Tensor,
                          nxt: torch.Tensor, checked: torch.Tensor, from_drafter: torch.Tensor,
                          offset: torch.Tensor, draft_probs: torch.Tensor,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled rows whose drafts came with their distribution q: keep each draft with
        probability min(1, p / q), else draw from the residual (`rejection_sample`), so the
        tokens follow the target's distribution; other drafts count as point masses (the
        sample-and-match of `_verify`, which is exact for them)."""
        sampler, slots = self.sampler, batch.token_slots
        pos = batch.positions + 1
        p = sampler.probs(logits, slots)
        q = draft_probs[slots, offset.clamp(0, draft_probs.shape[1] - 1)]
        q = torch.where(from_drafter[:, None], q, torch.zeros_like(q).scatter_(
            1, nxt.clamp(min=0)[:, None], 1.0))
        zero = torch.zeros(1, dtype=torch.int64, device=logits.device)
        accept_u = sampler.uniform(slots, pos, zero, ACCEPT_SALT)[:, 0]
        vocab = torch.arange(logits.shape[-1], device=logits.device)
        residual_u = sampler.uniform(slots, pos, vocab, RESIDUAL_SALT)
        _, token = rejection_sample(p, q, torch.where(checked, nxt, -1), accept_u, residual_u)
        sampled = (sampler.temperature[slots] > 0) & checked
        target = torch.where(sampled, token, target)
        return target, torch.log_softmax(logits.float(), -1).gather(1, target[:, None])[:, 0]

    def _sample(self, logits: torch.Tensor, slots: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.sampler is None:  # greedy, no log-probabilities
            return greedy_tokens(logits), None
        return self.sampler.sample(logits, slots, positions)


def _code_settings(obj: Any) -> Any:
    """`obj` without inductor's ``compile_threads`` (how many workers compile, not what)."""
    if isinstance(obj, dict):
        return {k: _code_settings(v) for k, v in obj.items() if k != "compile_threads"}
    if isinstance(obj, tuple):
        return tuple(_code_settings(v) for v in obj)
    return obj


def _check_vocab(drafter: StepDrafter, vocab_size: int | None) -> None:
    """ValueError when a draft model's vocabulary differs from the target's."""
    mine = getattr(drafter, "vocab_size", None)
    if vocab_size and mine and mine != vocab_size:
        raise ValueError(f"the draft model's vocab_size = {mine}, expected the target's "
                         f"{vocab_size}")


def _check_proposed(proposer: DraftProposer, drafts: Any, want: tuple[int, int],
                    device: torch.device) -> None:
    """ValueError unless a proposer's drafts are an integer tensor of `want` on `device`."""
    if not (is_integer_tensor(drafts) and tuple(drafts.shape) == want
            and same_device(drafts.device, device)):
        got = (f"{drafts.dtype} {tuple(drafts.shape)} on {drafts.device}"
               if isinstance(drafts, torch.Tensor) else type(drafts).__name__)
        raise ValueError(f"{type(proposer).__name__}.propose returned {got}, expected an "
                         f"integer tensor of shape {want} (rows, num_drafts) on {device}")
