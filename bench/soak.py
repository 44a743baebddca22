"""Soak: many random steps through the runner and a spec-decode state, invariants every step.

    python -m bench.soak [--steps 20000] [--seed 0] [--device cpu]

Runner part: requests join and leave, are preempted mid-prefill and readmitted, prompts are
chunk-prefilled under a token budget, some steps are dummy runs of a captured key; after
every step the CPU mirror must equal the device truth. Spec-decode part (a second state
driven by `graphattn.workload.SyntheticScheduler`, drafts verified with random rejections,
feedback two steps late): the bound must be >= the truth, and equal where no draft awaits
verification. RSS and the runner's caches (graphs, plans) are sampled to catch growth.
Prints one JSON line; exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from graphattn.buckets import BucketPolicy
from graphattn.capture.runner import GraphRunner
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState, SchedulerOutput
from graphattn.workload import SyntheticScheduler, WorkloadConfig, device_truth


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(steps: int, seed: int = 0, device: str = "cpu", progress: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    cfg = TinyConfig(vocab_size=64, hidden_size=32, num_layers=1)
    model = TinyDecoder(cfg).to(device)
    st = RequestState(8, 96, 8, device)
    model.allocate_caches(8 * st.max_num_blocks_per_req, 8)
    runner = GraphRunner(model, st, policy=BucketPolicy(
        capture_sizes=(1, 2, 4, 8), length_boundaries=(32, 64), mixed_token_sizes=(16, 32)))
    runner.capture(progress=False)
    keys = runner.dispatcher.all_keys()
    spec = RequestState(8, 96, 8, device)
    sched_spec = SyntheticScheduler(spec, WorkloadConfig(num_spec_tokens=3, feedback_delay=3,
                                                         max_new_tokens=(4, 30)), seed)
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
            else:
                rid, prompt = f"r{next_id}", rng.integers(0, cfg.vocab_size,
                                                          int(rng.integers(1, 40)))
                next_id += 1
            runner.add_request(rid, prompt)
            target[rid] = len(prompt) + int(rng.integers(1, 30))
        for rid, slot in list(st.req_id_to_slot.items()):
            n = int(st.num_computed_tokens_np[slot])
            if n >= min(target[rid], st.max_model_len - 1):
                st.remove_request(rid)
            elif n < st.num_prompt_tokens_np[slot] and rng.random() < 0.02:
                prompt = runner.token_ids[slot, : st.num_prompt_tokens_np[slot]].cpu().numpy()
                st.remove_request(rid)  # preempted mid-prefill: recomputed on readmission
                preempted.append((rid, prompt))
                preemptions += 1
        slots = np.array(sorted(st.req_id_to_slot.values()), np.int32)
        if step % 17 == 0:
            runner.dummy_run(keys[int(rng.integers(len(keys)))])
            dummy += 1
        if slots.size:
            left = st.num_prompt_tokens_np[slots] - st.num_computed_tokens_np[slots]
            want = np.where(left > 0, left, 1)
            take = np.minimum(want, np.maximum(32 - (np.cumsum(want) - want), 0))
            if take.any():
                runner.step(SchedulerOutput(slots[take > 0], take[take > 0]))
        truth = device_truth(st)
        active = st.active_np
        if not np.array_equal(st.num_computed_tokens_np[active], truth[active]):
            violations += 1
            first.append(f"runner step {step}: mirror {st.num_computed_tokens_np[active]} "
                         f"truth {truth[active]}")
        # spec decode on the state alone
        s = sched_spec.next_schedule()
        if s.num_reqs:
            sched_spec.finish_step(s)
        t = device_truth(spec)
        live = spec.active_np
        exact = live & (spec.num_pending_drafts_np == 0)
        if (spec.num_computed_tokens_np[live] < t[live]).any() or not np.array_equal(
                spec.num_computed_tokens_np[exact], t[exact]):
            violations += 1
            first.append(f"spec step {step}: bound {spec.num_computed_tokens_np[live]} "
                         f"truth {t[live]}")
    return {"steps": steps, "seed": seed, "device": device, "violations": violations,
            "first_violations": first[:3], "requests": next_id, "preemptions": preemptions,
            "dummy_runs": dummy, "graphs": len(runner.graphs.keys),
            "plans_cached": len(runner._plans), "rss_mib_start": rss0,
            "rss_mib_end": _rss_mib(), "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    result = run(args.steps, args.seed, args.device, progress=True)
    print(json.dumps(result))
    raise SystemExit(1 if result["violations"] else 0)


if __name__ == "__main__":
    main()
