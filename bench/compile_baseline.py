"""torch.compile(mode="reduce-overhead") baseline for uniform decode, in its own process.

The model forward is compiled with inductor's CUDA graphs and run by a
GraphRunner that captured nothing: each step is planned for its key (padded
sizes, bucketed length, so shapes repeat and nothing recompiles per length)
and runs prepare, build and the write-back eagerly around the compiled
forward. An untimed pass over the same steps first compiles every key the
timed pass meets, so no compile lands in the timing. Run by
bench.graph_replay as a subprocess (dynamo never meets the sync-counting
dispatch mode there); prints one JSON row per batch size.

    python -m bench.compile_baseline --sizes 1,8,32,128 --steps 200
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from bench.graph_replay import BOUNDARIES, MAX_LEN
from bench.setup import fill_requests, make_setup, set_lengths
from bench.timing import WARMUP, us_per_step
from graphattn.capture.runner import BucketPolicy, GraphRunner
from graphattn.state import SchedulerOutput


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1,8,32,128")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    device = "cuda"
    policy = BucketPolicy(capture_sizes=sizes, length_boundaries=BOUNDARIES)
    setup = make_setup(device, max(sizes), MAX_LEN, policy)
    rng = np.random.default_rng(0)
    lengths = rng.integers(128, 384, max(sizes)).astype(np.int32)
    fill_requests(setup, max(sizes), lengths, rng)
    # the model's forward without its inference_mode decorator, under no_grad
    plain = type(setup.model).forward.__wrapped__

    def forward(inputs, meta):
        with torch.no_grad():
            return plain(setup.model, inputs, meta)

    compiled = torch.compile(forward, mode="reduce-overhead")
    runner = GraphRunner(compiled, setup.state, policy=policy)
    runner.token_ids, runner.prompt_lens = setup.runner.token_ids, setup.runner.prompt_lens
    from torch._dynamo.utils import counters

    for n in sizes:
        sched = SchedulerOutput(np.arange(n, dtype=np.int32), np.ones(n, np.int32))
        row = {"scenario": "uniform_decode", "mode": "compile_reduce_overhead", "batch": n}
        try:
            skips0 = counters["inductor"].get("cudagraph_skips", 0)
            graphs0 = counters["stats"].get("unique_graphs", 0)
            # one untimed pass over the timed sequence compiles and records every key it
            # meets (lengths cross a bucket boundary on the way)
            t0 = time.perf_counter()
            for _ in range(WARMUP + args.steps):
                runner.step(sched)
            torch.cuda.synchronize()
            row["compile_s"] = time.perf_counter() - t0
            graphs1 = counters["stats"].get("unique_graphs", 0)
            set_lengths(setup.state, lengths)
            step = lambda s=sched: runner.step(s)  # noqa: E731
            row["us_step"] = us_per_step(step, args.steps, device)
            row["skipped_cudagraphs"] = counters["inductor"].get("cudagraph_skips", 0) > skips0
            row["dynamo_graphs"] = graphs1 - graphs0
            row["timed_recompiles"] = counters["stats"].get("unique_graphs", 0) - graphs1
        except Exception as e:  # recorded in the table, not hidden
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        set_lengths(setup.state, lengths)
        print("ROW " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
