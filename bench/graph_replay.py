"""Uniform decode, side by side in one run: eager with a host read per step, eager
sync-free, graphattn graph replay, torch.compile(mode="reduce-overhead"), and the
replay-only floor.

    python -m bench.graph_replay [--sizes 1,8,32,128] [--steps 200]
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch

from bench.setup import Setup, fill_requests, make_setup
from bench.timing import syncs_per_step, us_per_step
from capture.runner import BucketPolicy, GraphRunner
from graphattn.state import SchedulerOutput
from graphattn.sync import opaque_region

MAX_LEN = 1024
BOUNDARIES = (256, 512)


def _reset(setup: Setup, lengths: np.ndarray) -> None:
    n = lengths.shape[0]
    setup.state.num_computed_tokens_np[:n] = lengths
    setup.state.num_computed_tokens[:n].copy_(torch.from_numpy(lengths.astype(np.int32)))


def decode_modes(setup: Setup, sizes: tuple[int, ...], steps: int, device: str,
                 compile_baseline: bool = True, scenario: str = "uniform_decode") -> list[dict]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(128, 384, max(sizes)).astype(np.int32)
    fill_requests(setup, max(sizes), lengths, rng)
    runner, st = setup.runner, setup.state
    rows = []
    compiled_runner = None
    if compile_baseline and device == "cuda":
        compiled = torch.compile(setup.model.forward, mode="reduce-overhead")

        def compiled_forward(inputs, meta, compiled=compiled):
            with opaque_region():  # dynamo cannot run under the sync-counting dispatch mode
                return compiled(inputs, meta)

        compiled_runner = GraphRunner(compiled_forward, st, policy=runner.policy)
        compiled_runner.token_ids = runner.token_ids
        compiled_runner.prompt_lens = runner.prompt_lens
    for n in sizes:
        sched = SchedulerOutput(np.arange(n, dtype=np.int32), np.ones(n, np.int32))

        def host_read(sched=sched, n=n):
            int(st.num_computed_tokens[:n].max())  # the pre-upper-bound pattern
            return runner.step(sched, force_eager=True)

        modes = {
            "host_read": host_read,
            "eager": lambda sched=sched: runner.step(sched, force_eager=True),
            "graphs": lambda sched=sched: runner.step(sched),
        }
        key = runner.step(sched).key
        _reset(setup, lengths)
        if compiled_runner is not None:
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    for _ in range(3):
                        compiled_runner.step(sched, force_eager=True)
                    modes["compile_reduce_overhead"] = (
                        lambda sched=sched: compiled_runner.step(sched, force_eager=True))
                except Exception as e:  # recorded, not hidden
                    rows.append({"scenario": scenario, "mode": "compile_reduce_overhead",
                                 "batch": n, "error": f"{type(e).__name__}: {e}"[:300]})
            compile_s = time.perf_counter() - t0
            skipped = any("skipping cudagraphs" in str(w.message) for w in caught)
            _reset(setup, lengths)
        if key is not None:
            modes["replay_floor"] = lambda key=key: runner.graphs.replay_only(key)
        floor = None
        for mode, fn in modes.items():
            us = us_per_step(fn, steps, device)
            _reset(setup, lengths)
            syncs = syncs_per_step(fn) if mode != "replay_floor" else 0.0
            _reset(setup, lengths)
            row = {"scenario": scenario, "mode": mode, "batch": n, "us_step": us,
                   "syncs_per_step": syncs, "key": str(key)}
            if mode == "compile_reduce_overhead":
                row["compile_s"] = compile_s
                row["skipped_cudagraphs"] = skipped
            rows.append(row)
            if mode == "replay_floor":
                floor = us
        for row in rows:
            if row.get("batch") == n and floor and "us_step" in row:
                row["gpu_idle_frac"] = max(0.0, 1 - floor / row["us_step"])
    return rows


def run(device: str, sizes: tuple[int, ...], steps: int) -> tuple[list[dict], dict]:
    policy = BucketPolicy(capture_sizes=tuple(sorted(set(sizes))), length_boundaries=BOUNDARIES)
    setup = make_setup(device, max(sizes), MAX_LEN, policy)
    report = setup.runner.capture()
    info = {"graphs": report.num_graphs, "capture_s": report.seconds,
            "pool_mb": report.pool_bytes / 2**20}
    return decode_modes(setup, sizes, steps, device), info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1,8,32,128")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, info = run(device, tuple(int(s) for s in args.sizes.split(",")), args.steps)
    print(info)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
