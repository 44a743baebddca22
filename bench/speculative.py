"""Speculative decoding inside the step: plain decoding, the n-gram proposer and draft models,
at fixed batch sizes, side by side in one process.

    python -m bench.speculative [--model 1b] [--sizes 1,8,32] [--ks 2,4] [--out DIR]

Every row decodes `--new` tokens per request after a `--prompt`-token prefill, every
decode step a replayed full graph (k + 1 tokens per row for the speculative rows, drafts
verified inside it) with the previous step's tokens and feedback read one step late.
Drafters: `ngram` (`NgramProposer`), `draft-random` (a random 2-layer model of the
target's shape) and `draft-exact` (the target's first 2 layers, embedding and head: the
target's later layers have their o and down projections zeroed, so they add nothing to
the residual stream while their weights are still read every step, and the truncation
agrees with the target token for token). Columns: tokens/s, step µs (wall over decode
steps), acceptance, host reads of device state per step (`host_syncs_per_step`, counted over
two steps after the timed ones), `draft_share` = 1 - step µs(ngram, same k) / step µs(row): the part
of the step the draft model's passes take, the n-gram proposer's cost standing for none.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from bench.setup import MODELS, result_meta
from graphattn import DraftModelProposer, GraphRunner, NgramProposer, RunnerConfig
from graphattn.buckets import BucketPolicy
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import count_host_syncs

BLOCK = 16


def exact_truncated_draft(target: TinyDecoder, layers: int = 2) -> TinyDecoder:
    """Zero the o and down projections of `target`'s layers past `layers` (in place) and
    return a `layers`-layer model sharing its embedding, first layers, norm and head: the
    two agree on every token (their residual streams are equal)."""
    for layer in target.layers[layers:]:
        torch.nn.init.zeros_(layer.o.weight)
        torch.nn.init.zeros_(layer.down.weight)
    c = target.cfg
    cfg = TinyConfig(c.vocab_size, c.hidden_size, layers, c.num_heads, c.num_kv_heads,
                     c.intermediate_size, c.rope_theta)
    p = next(target.parameters())
    draft = TinyDecoder(cfg).to(p.device, p.dtype)
    draft.embed, draft.norm, draft.lm_head = target.embed, target.norm, target.lm_head
    draft.layers = torch.nn.ModuleList(list(target.layers[:layers]))
    return draft


def make_drafter(kind: str, target: TinyDecoder, state: RequestState) -> object | None:
    if kind == "plain":
        return None
    if kind == "ngram":
        return NgramProposer(n=2, window=64)
    p = next(target.parameters())
    if kind == "draft-exact":
        draft = exact_truncated_draft(target)
    else:
        c = target.cfg
        torch.manual_seed(1)
        draft = TinyDecoder(TinyConfig(c.vocab_size, c.hidden_size, 2, c.num_heads,
                                       c.num_kv_heads, c.intermediate_size, c.rope_theta)
                            ).to(p.device, p.dtype)
    draft.allocate_caches(state.num_kv_blocks, BLOCK)
    return DraftModelProposer(draft)


def run_row(target: TinyDecoder, kind: str, k: int, batch: int, args: argparse.Namespace,
            sizes: tuple[int, ...]) -> dict:
    """Prefill `batch` requests, then time `args.new` tokens each."""
    q = 1 if kind == "plain" else k + 1
    st = RequestState(max(sizes), args.prompt + 2 * args.new + 4 * (k + 1), BLOCK, args.device)
    target.allocate_caches(st.num_kv_blocks, BLOCK)
    policy = BucketPolicy(capture_sizes=sizes, length_boundaries=(st.max_model_len,),
                          decode_query_len=q)
    runner = GraphRunner(target, st, RunnerConfig(policy=policy),
                         proposer=make_drafter(kind, target, st))
    runner.capture([key for key in runner.dispatcher.all_keys()
                    if key.num_reqs_padded == batch], progress=False)
    rng = np.random.default_rng(0)
    slots = np.array([runner.add_request(f"r{i}", rng.integers(1, target.cfg.vocab_size,
                                                               args.prompt))
                      for i in range(batch)], np.int32)
    for s in slots:  # prefill eagerly, one request at a time
        runner.step(SchedulerOutput(np.array([s]), np.array([args.prompt])), force_eager=True)
    drafts = np.full(batch, q - 1, np.int32)
    sched = SchedulerOutput(slots, drafts + 1, drafts if q > 1 else None)
    emitted = steps = 0
    pending = None
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while emitted < batch * args.new:
        out = runner.step(sched)
        if pending is not None:
            emitted += _consume(runner, pending)
        pending, steps = out, steps + 1
    emitted += _consume(runner, pending)
    wall = time.perf_counter() - t0
    accepted = (emitted - batch * steps) / (batch * steps * k) if q > 1 else None
    return {"drafter": kind, "k": k if q > 1 else 0, "batch": batch, "steps": steps,
            "tokens_per_s": emitted / wall, "step_us": 1e6 * wall / steps,
            "acceptance": accepted, "host_syncs_per_step": _syncs_per_step(runner, sched)}


def _syncs_per_step(runner: GraphRunner, sched: SchedulerOutput, steps: int = 2) -> float:
    """Host reads of device state inside `step()`, over `steps` more steps after the timed
    ones (counted outside the timing: the counter hooks every dispatched op)."""
    syncs = 0
    for _ in range(steps):
        with count_host_syncs() as c:
            out = runner.step(sched)
        syncs += c.count
        _consume(runner, out)
    return syncs / steps


def _consume(runner: GraphRunner, out) -> int:
    """Tokens the step emitted (read one step late); applies its feedback."""
    row = out.emitted_host.wait() if out.emitted_host is not None else out.sampled_host.wait()
    if out.feedback is not None:
        runner.apply_feedback(out)
    return int((row >= 0).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS),
                    help="target shape (random weights)")
    ap.add_argument("--sizes", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--ks", default="2,4", help="comma-separated drafts per step")
    ap.add_argument("--drafters", default="ngram,draft-random,draft-exact",
                    help="comma-separated: ngram, draft-random, draft-exact")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=64, help="tokens timed per request")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="folder for speculative_DEVICE.json")
    args = ap.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    ks = [int(k) for k in args.ks.split(",")]
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target = TinyDecoder(MODELS[args.model]).to(args.device, dtype)
    exact = copy.deepcopy(target)  # zeroed past layer 2: its own plain rows beside it
    plan = [(target, "plain", 0)] + [(exact, "plain-exact", 0)] + [
        (exact if d == "draft-exact" else target, d, k)
        for k in ks for d in args.drafters.split(",")]
    exact_truncated_draft(exact)
    rows = []
    with torch.inference_mode():
        for model, kind, k in tqdm(plan, desc="speculative", unit="drafter"):
            for b in sizes:
                row = run_row(model, "plain" if kind == "plain-exact" else kind, k, b, args,
                              sizes)
                row["drafter"] = kind
                rows.append(row)
                print(json.dumps(row), flush=True)
    _shares(rows)
    meta = result_meta("bench.speculative", args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"speculative_{args.device}.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1))


def _shares(rows: list[dict]) -> None:
    """draft_share and speedup over plain decoding of the same target and batch."""
    ngram = {(r["k"], r["batch"]): r["step_us"] for r in rows if r["drafter"] == "ngram"}
    plain = {(r["drafter"] == "plain-exact", r["batch"]): r["tokens_per_s"] for r in rows
             if r["drafter"].startswith("plain")}
    for r in rows:
        if r["drafter"].startswith("draft") and (r["k"], r["batch"]) in ngram:
            r["draft_share"] = 1 - ngram[r["k"], r["batch"]] / r["step_us"]
        base = plain.get((r["drafter"] == "draft-exact", r["batch"]))
        if base:
            r["speedup_vs_plain"] = r["tokens_per_s"] / base


if __name__ == "__main__":
    main()
