"""Soak: many random steps through the runner and a spec-decode state, invariants every step.

    python -m bench.soak [--steps 20000] [--seed 0] [--device cpu]

Requests join (half of them after one of three shared system prompts, admitted through a
`BlockManager` with prefix caching: hits share read-only KV blocks) and leave, are
preempted mid-prefill and readmitted, prompts are
chunk-prefilled under a token budget, decode rows carry random drafts that the runner
verifies inside the step, their feedback is applied one or two steps late (or refused as
stale once the request is gone), and some steps are dummy runs of a captured key. After
every step the CPU bound must be >= the device truth, and equal to it wherever no draft
awaits verification. RSS and the runner's caches (graphs, plans) are sampled to catch growth.
Prints one JSON line; exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from bench.workload import device_truth
from graphattn import GraphRunner, RunnerConfig
from graphattn.blocks import BlockManager
from graphattn.buckets import BucketPolicy
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState, SchedulerOutput


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(steps: int, seed: int = 0, device: str = "cpu", progress: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    cfg = TinyConfig(vocab_size=64, hidden_size=32, num_layers=1)
    model = TinyDecoder(cfg).to(device)
    st = RequestState(8, 96, 8, device)
    model.allocate_caches(8 * st.max_num_blocks_per_req, 8)
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(
        capture_sizes=(1, 2, 4, 8), length_boundaries=(32, 64), mixed_token_sizes=(16, 32, 64),
        decode_query_len=3)))
    runner.capture(progress=False)
    keys = runner.dispatcher.all_keys()
    blocks = BlockManager(st.num_kv_blocks, st.block_size)  # prefix caching on
    systems = [rng.integers(0, cfg.vocab_size, 24) for _ in range(3)]
    cached: set[str] = set()
    pending: list = []
    stale = runner_steps = drafted = 0
    target: dict[str, int] = {}
    preempted: list[tuple[str, np.ndarray]] = []
    next_id = violations = dummy = preemptions = 0
    first: list[str] = []
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    for step in tqdm(range(steps), desc="soak", unit="step", disable=not progress):
        # joins (fresh or readmitted after preemption) and leaves
        while st.num_active < st.max_num_reqs and rng.random() < 0.4:
            if preempted and rng.random() < 0.5:
                rid, prompt = preempted.pop()
            else:  # half of them after one of three shared system prompts
                own = rng.integers(0, cfg.vocab_size, int(rng.integers(1, 40)))
                prompt = own if rng.random() < 0.5 else np.concatenate(
                    [systems[int(rng.integers(3))][: int(rng.integers(8, 25))], own])[:60]
                rid = f"r{next_id}"
                next_id += 1
                target[rid] = len(prompt) + int(rng.integers(1, 30))
            ids, computed = blocks.allocate(rid, prompt, min(target[rid] + 3, st.max_model_len))
            runner.add_request(rid, prompt, ids, num_computed_tokens=computed)
        for rid, slot in list(st.req_id_to_slot.items()):
            n = int(st.num_computed_tokens_np[slot])
            prompt_len = int(st.num_prompt_tokens_np[slot])
            if n >= min(target[rid], st.max_model_len - 1):
                st.remove_request(rid)
                blocks.free(rid)
                cached.discard(rid)
            elif n < prompt_len and rng.random() < 0.02:
                prompt = runner.token_ids[slot, :prompt_len].cpu().numpy()
                st.remove_request(rid)  # preempted mid-prefill: recomputed on readmission
                blocks.free(rid)
                preempted.append((rid, prompt))
                preemptions += 1
            elif rid not in cached and st.lower_bounds(np.array([slot]))[0] >= prompt_len:
                blocks.cache(rid, runner.token_ids[slot, :prompt_len].cpu().numpy())
                cached.add(rid)  # its prompt's KV is written: later prompts hit it
        slots = np.array(sorted(st.req_id_to_slot.values()), np.int32)
        if step % 17 == 0:
            runner.dummy_run(keys[int(rng.integers(len(keys)))])
            dummy += 1
        if slots.size:
            left = st.num_prompt_tokens_np[slots] - st.num_computed_tokens_np[slots]
            room = st.max_model_len - st.num_computed_tokens_np[slots] - 1
            drafts = np.where((left <= 0) & (room >= 2) & (rng.random(slots.size) < 0.7), 2, 0)
            want = np.where(left > 0, left, 1 + drafts)
            take = np.minimum(want, np.maximum(32 - (np.cumsum(want) - want), 0))
            take = np.where(left > 0, take, want * (take == want))  # decode rows whole or not
            keep = take > 0
            if keep.any():
                d = drafts[keep].astype(np.int32)
                out = runner.step(SchedulerOutput(slots[keep], take[keep], d),
                                  draft_token_ids=rng.integers(0, cfg.vocab_size, int(d.sum())))
                runner_steps += 1
                drafted += int(d.sum())
                if out.feedback is not None:
                    pending.append(out)
        while len(pending) > int(rng.integers(1, 3)):  # feedback one or two steps late
            stale += int(runner.apply_feedback(pending.pop(0)).stale.sum())
        truth = device_truth(st)
        live = st.active_np
        exact = live & (st.num_pending_drafts_np == 0)
        if (st.num_computed_tokens_np[live] < truth[live]).any() or not np.array_equal(
                st.num_computed_tokens_np[exact], truth[exact]):
            violations += 1
            first.append(f"step {step}: bound {st.num_computed_tokens_np[live]} "
                         f"truth {truth[live]} pending {st.num_pending_drafts_np[live]}")
    return {"steps": steps, "seed": seed, "device": device, "violations": violations,
            "first_violations": first[:3], "requests": next_id, "preemptions": preemptions,
            "dummy_runs": dummy, "runner_steps": runner_steps, "drafts": drafted,
            "stale_feedback_rows": stale, "prefix_hit_tokens": blocks.num_hits,
            "prompt_tokens": blocks.num_queried,
            "graphs": len(runner.graphs.keys),
            "plans_cached": len(runner._plans), "rss_mib_start": rss0,
            "rss_mib_end": _rss_mib(), "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20000, help="random steps to drive")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random schedule")
    ap.add_argument("--device", default="cpu", help="torch device of the runner")
    ap.add_argument("--out", default=None, help="folder to write soak.json into")
    args = ap.parse_args()
    result = run(args.steps, args.seed, args.device, progress=True)
    result.update(date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                  command="python -m bench.soak " + " ".join(sys.argv[1:]))
    print(json.dumps(result))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "soak.json").write_text(json.dumps(result, indent=1))
    raise SystemExit(1 if result["violations"] else 0)


if __name__ == "__main__":
    main()
