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
from bench.timing import WARMUP, syncs_per_step, us_per_step
from graphattn.capture.runner import BucketPolicy
from graphattn.state import SchedulerOutput

MAX_LEN = 1024
BOUNDARIES = (256, 512)


def decode_modes(setup: Setup, sizes: tuple[int, ...], steps: int, device: str,
                 scenario: str = "uniform_decode") -> list[dict]:
    """host_read, eager, graphs and replay_floor rows for each batch size.

    The floor replays, with no host work in between, the very keys the graphs
    mode used step by step (lengths grow across a bucket boundary during a
    run, so one fixed key would understate the floor).
    """
    rng = np.random.default_rng(0)
    lengths = rng.integers(128, 384, max(sizes)).astype(np.int32)
    fill_requests(setup, max(sizes), lengths, rng)
    runner, st = setup.runner, setup.state
    rows = []
    for n in sizes:
        sched = SchedulerOutput(np.arange(n, dtype=np.int32), np.ones(n, np.int32))
        keys: list = []
        host_s: list[float] = []

        def measure(mode: str, fn, count_syncs: bool = True, n=n) -> dict:
            set_lengths(st, lengths)
            row = {"scenario": scenario, "mode": mode, "batch": n,
                   "us_step": us_per_step(fn, steps, device)}
            set_lengths(st, lengths)
            row["syncs_per_step"] = syncs_per_step(fn) if count_syncs else 0.0
            return row

        def host_read(sched=sched, n=n):
            int(st.num_computed_tokens[:n].max())  # the pre-upper-bound pattern
            return runner.step(sched, force_eager=True)

        def graphs(sched=sched, keys=keys, host_s=host_s):
            out = runner.step(sched)
            keys.append(out.key if out.replayed else None)
            host_s.append(out.host_seconds)

        rows.append(measure("host_read", host_read))
        rows.append(measure("eager", lambda sched=sched: runner.step(sched, force_eager=True)))
        rows.append(measure("graphs", graphs))
        timed = keys[: WARMUP + steps]  # the syncs count appended a few more
        if None in timed:
            raise RuntimeError(f"batch {n}: a graphs-mode step ran eager; no floor to compare")
        host = 1e6 * np.asarray(host_s[: WARMUP + steps])
        rows[-1].update(keys=sorted({str(k) for k in timed}), host_us=float(np.median(host)),
                        host_us_mean=float(host.mean()), host_us_p99=float(np.percentile(host, 99)))
        seq = iter(timed)
        rows.append(measure("replay_floor", lambda seq=seq: runner.graphs.replay_only(next(seq)),
                            count_syncs=False))
    set_lengths(st, lengths)
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
    """GPU idle ≈ 1 - floor / step and step / floor - 1, the floor being the replay-only
    time of the same keys."""
    floors = {r["batch"]: r["us_step"] for r in rows if r.get("mode") == "replay_floor"}
    for r in rows:
        if r.get("batch") in floors and "us_step" in r:
            r["gpu_idle_frac"] = max(0.0, 1 - floors[r["batch"]] / r["us_step"])
            r["vs_floor"] = r["us_step"] / floors[r["batch"]] - 1


def run(device: str, sizes: tuple[int, ...], steps: int,
        compile_baseline: bool = True) -> tuple[list[dict], dict]:
    policy = BucketPolicy(capture_sizes=tuple(sorted(set(sizes))), length_boundaries=BOUNDARIES)
    setup = make_setup(device, max(sizes), MAX_LEN, policy)
    report = setup.runner.capture()
    info = {"graphs": report.num_graphs, "capture_s": report.seconds,
            "pool_mb": report.pool_bytes / 2**20}
    rows = decode_modes(setup, sizes, steps, device)
    if device == "cuda" and compile_baseline:
        rows += compile_rows(sizes, steps)
    add_idle_fraction(rows)
    return rows, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1,8,32,128")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, info = run(device, tuple(int(s) for s in args.sizes.split(",")), args.steps,
                     not args.no_compile)
    print(info)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
