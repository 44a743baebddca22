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
    """Drive `steps` random steps and check the invariants after each (see the module)."""
    soak = _Soak(seed, device)
    t0 = time.perf_counter()
    for step in tqdm(range(steps), desc="soak", unit="step", disable=not progress):
        soak.admit()
        soak.retire()
        soak.step(step)
        soak.check(step)
    return {"steps": steps, "seed": seed, "device": device, **soak.counts(),
            "seconds": time.perf_counter() - t0}


class _Soak:
    """The runner, its state and block manager, the random schedule and the tallies."""

    def __init__(self, seed: int, device: str) -> None:
        self.rng = np.random.default_rng(seed)
        torch.manual_seed(seed)
        self.cfg = TinyConfig(vocab_size=64, hidden_size=32, num_layers=1)
        model = TinyDecoder(self.cfg).to(device)
        self.st = st = RequestState(8, 96, 8, device)
        model.allocate_caches(8 * st.max_num_blocks_per_req, 8)
        self.runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(
            capture_sizes=(1, 2, 4, 8), length_boundaries=(32, 64),
            mixed_token_sizes=(16, 32, 64), decode_query_len=3)))
        self.runner.capture(progress=False)
        self.keys = self.runner.dispatcher.all_keys()
        self.blocks = BlockManager(st.num_kv_blocks, st.block_size)  # prefix caching on
        self.systems = [self.rng.integers(0, self.cfg.vocab_size, 24) for _ in range(3)]
        self.cached: set[str] = set()
        self.pending: list = []
        self.target: dict[str, int] = {}
        self.preempted: list[tuple[str, np.ndarray]] = []
        self.first: list[str] = []
        self.stale = self.runner_steps = self.drafted = self.next_id = 0
        self.violations = self.dummy = self.preemptions = 0
        self.rss0 = _rss_mib()

    def admit(self) -> None:
        """Joins: fresh requests (half of them after one of three shared system prompts) or
        ones readmitted after preemption, through the block manager's prefix lookup."""
        st, rng = self.st, self.rng
        while st.num_active < st.max_num_reqs and rng.random() < 0.4:
            if self.preempted and rng.random() < 0.5:
                rid, prompt = self.preempted.pop()
            else:
                own = rng.integers(0, self.cfg.vocab_size, int(rng.integers(1, 40)))
                prompt = own if rng.random() < 0.5 else np.concatenate(
                    [self.systems[int(rng.integers(3))][: int(rng.integers(8, 25))], own])[:60]
                rid = f"r{self.next_id}"
                self.next_id += 1
                self.target[rid] = len(prompt) + int(rng.integers(1, 30))
            ids, computed = self.blocks.allocate(rid, prompt,
                                                 min(self.target[rid] + 3, st.max_model_len))
            self.runner.add_request(rid, prompt, ids, num_computed_tokens=computed)

    def retire(self) -> None:
        """Leaves at the target length, preemptions mid-prefill, and prompts cached once
        their KV is written."""
        st, blocks = self.st, self.blocks
        for rid, slot in list(st.req_id_to_slot.items()):
            n = int(st.num_computed_tokens_np[slot])
            prompt_len = int(st.num_prompt_tokens_np[slot])
            if n >= min(self.target[rid], st.max_model_len - 1):
                st.remove_request(rid)
                blocks.free(rid)
                self.cached.discard(rid)
            elif n < prompt_len and self.rng.random() < 0.02:
                prompt = self.runner.token_ids[slot, :prompt_len].cpu().numpy()
                st.remove_request(rid)  # preempted mid-prefill: recomputed on readmission
                blocks.free(rid)
                self.preempted.append((rid, prompt))
                self.preemptions += 1
            elif rid not in self.cached and st.lower_bounds(np.array([slot]))[0] >= prompt_len:
                blocks.cache(rid, self.runner.token_ids[slot, :prompt_len].cpu().numpy())
                self.cached.add(rid)  # its prompt's KV is written: later prompts hit it

    def step(self, step: int) -> None:
        """A dummy run every 17th step; a step of chunked prefills under a 32-token budget
        and decode rows with random drafts; feedback applied one or two steps late."""
        st, rng, runner = self.st, self.rng, self.runner
        slots = np.array(sorted(st.req_id_to_slot.values()), np.int32)
        if step % 17 == 0:
            runner.dummy_run(self.keys[int(rng.integers(len(self.keys)))])
            self.dummy += 1
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
                                  draft_token_ids=rng.integers(0, self.cfg.vocab_size,
                                                               int(d.sum())))
                self.runner_steps += 1
                self.drafted += int(d.sum())
                if out.feedback is not None:
                    self.pending.append(out)
        while len(self.pending) > int(rng.integers(1, 3)):
            self.stale += int(runner.apply_feedback(self.pending.pop(0)).stale.sum())

    def check(self, step: int) -> None:
        """The CPU bound >= the device truth, equal where no draft awaits verification."""
        st = self.st
        truth = device_truth(st)
        live = st.active_np
        exact = live & (st.num_pending_drafts_np == 0)
        if (st.num_computed_tokens_np[live] < truth[live]).any() or not np.array_equal(
                st.num_computed_tokens_np[exact], truth[exact]):
            self.violations += 1
            self.first.append(f"step {step}: bound {st.num_computed_tokens_np[live]} "
                              f"truth {truth[live]} pending {st.num_pending_drafts_np[live]}")

    def counts(self) -> dict:
        return {"violations": self.violations, "first_violations": self.first[:3],
                "requests": self.next_id, "preemptions": self.preemptions,
                "dummy_runs": self.dummy, "runner_steps": self.runner_steps,
                "drafts": self.drafted, "stale_feedback_rows": self.stale,
                "prefix_hit_tokens": self.blocks.num_hits,
                "prompt_tokens": self.blocks.num_queried,
                "graphs": len(self.runner.graphs.keys),
                "plans_cached": len(self.runner._plans), "rss_mib_start": self.rss0,
                "rss_mib_end": _rss_mib()}


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
