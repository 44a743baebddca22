"""Uniform decode, side by side in one run: eager with a host read per step, eager
sync-free, graphattn graph replay, torch.compile(mode="reduce-overhead"), and the
replay-only floor.

    python -m bench.graph_replay [--sizes 1,8,32,128] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import torch

from bench.setup import Setup, fill_requests, make_setup, set_lengths
from bench.timing import syncs_per_step, us_per_step
from capture.runner import BucketPolicy
from graphattn.state import SchedulerOutput

MAX_LEN = 1024
BOUNDARIES = (256, 512)


def decode_modes(setup: Setup, sizes: tuple[int, ...], steps: int, device: str,
                 scenario: str = "uniform_decode") -> list[dict]:
    """host_read, eager, graphs and replay_floor rows for each batch size."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(128, 384, max(sizes)).astype(np.int32)
    fill_requests(setup, max(sizes), lengths, rng)
    runner, st = setup.runner, setup.state
    rows = []
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
        set_lengths(st, lengths)
        if key is not None:
            modes["replay_floor"] = lambda key=key: runner.graphs.replay_only(key)
        for mode, fn in modes.items():
            us = us_per_step(fn, steps, device)
            set_lengths(st, lengths)
            syncs = syncs_per_step(fn) if mode != "replay_floor" else 0.0
            set_lengths(st, lengths)
            rows.append({"scenario": scenario, "mode": mode, "batch": n, "us_step": us,
                         "syncs_per_step": syncs, "key": str(key)})
    return rows


def compile_rows(sizes: tuple[int, ...], steps: int) -> list[dict]:
    """The torch.compile baseline, from a subprocess (see bench.compile_baseline)."""
    cmd = [sys.executable, "-m", "bench.compile_baseline", "--sizes",
           ",".join(map(str, sizes)), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if proc.returncode and not rows:
        rows = [{"scenario": "uniform_decode", "mode": "compile_reduce_overhead",
                 "error": proc.stderr[-300:]}]
    return rows


def add_idle_fraction(rows: list[dict]) -> None:
    """GPU idle ≈ 1 - floor / step, the floor being the replay-only time of the same key."""
    floors = {r["batch"]: r["us_step"] for r in rows if r.get("mode") == "replay_floor"}
    for r in rows:
        if r.get("batch") in floors and "us_step" in r:
            r["gpu_idle_frac"] = max(0.0, 1 - floors[r["batch"]] / r["us_step"])


def run(device: str, sizes: tuple[int, ...], steps: int) -> tuple[list[dict], dict]:
    policy = BucketPolicy(capture_sizes=tuple(sorted(set(sizes))), length_boundaries=BOUNDARIES)
    setup = make_setup(device, max(sizes), MAX_LEN, policy)
    report = setup.runner.capture()
    info = {"graphs": report.num_graphs, "capture_s": report.seconds,
            "pool_mb": report.pool_bytes / 2**20}
    rows = decode_modes(setup, sizes, steps, device)
    if device == "cuda":
        rows += compile_rows(sizes, steps)
    add_idle_fraction(rows)
    return rows, info


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
