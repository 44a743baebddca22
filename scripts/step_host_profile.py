"""Where a replayed step's host time goes (a development aid): the tiny bench model, one
batch / length, the bench's loop (tokens read one step late), then the stage timer and
cProfile over the same loop.

    python scripts/step_host_profile.py [--device cuda] [--batch 8] [--length 512] [--out DIR]

Off CUDA the runner's device step is stubbed (its outputs are fixed tensors), so the
numbers are the CPU planning and bookkeeping alone.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import numpy as np
import torch

from bench.graph_replay import MODELS, replay_policy
from bench.setup import fill_requests, make_setup, set_lengths
from capture.profiling import StageProfiler
from capture.runner import GraphRunner
from graphattn.state import SchedulerOutput


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n, steps = args.batch, args.steps
    policy, max_len = replay_policy((n,), (args.length,), 4 * steps)
    setup = make_setup(args.device, n, max_len, policy, MODELS["tiny"])
    fill_requests(setup, n, np.full(n, 16, np.int32), np.random.default_rng(0))
    runner = setup.runner
    if args.compile:
        runner = GraphRunner(setup.model, setup.state, policy=policy, compile=True)
    if args.device == "cuda":
        runner.capture(progress=False)
    else:
        fixed = None

        def stub(packed, plan, key, piecewise=False):
            nonlocal fixed
            r = plan.num_reqs_padded
            if fixed is None or fixed[0].shape[0] != r:
                fixed = (torch.zeros(r, 8), torch.zeros(r, dtype=torch.long), torch.zeros(r),
                         None, None)
            return fixed

        runner._device_step = stub
    lens = np.random.default_rng(1).integers(args.length - 16, args.length + 16, n)
    set_lengths(setup.state, lens.astype(np.int32))
    sched = SchedulerOutput(np.arange(n, dtype=np.int32), np.ones(n, np.int32))
    late: list = []

    def step() -> float:
        out = runner.step(sched)
        if late:
            late.pop().wait()
        late.append(out.sampled_host)
        return out.host_seconds

    def loop() -> tuple[float, float]:
        t0 = time.perf_counter()
        host = [step() for _ in range(steps)]
        return 1e6 * float(np.median(host)), 1e6 * (time.perf_counter() - t0) / steps

    loop()
    host_us, loop_us = loop()
    runner.profiler = StageProfiler(nvtx_ranges=False, torch_labels=False, record_times=True)
    loop()
    stages = {k: round(1e6 * float(np.median(v)), 1) for k, v in runner.profiler.times.items()}
    runner.profiler = StageProfiler()
    prof = cProfile.Profile()
    prof.enable()
    loop()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(45)
    row = {"device": args.device, "batch": n, "length": args.length, "host_us": host_us,
           "loop_us": loop_us, "stages_us": stages, "torch": torch.__version__}
    print(json.dumps(row))
    print(text.getvalue())
    if args.out:
        path = Path(args.out) / f"step_host_profile_{args.device}_{n}_{args.length}.txt"
        path.write_text(json.dumps(row) + "\n" + text.getvalue())


if __name__ == "__main__":
    main()
