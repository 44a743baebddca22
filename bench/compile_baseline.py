"""torch.compile(mode="reduce-overhead") baseline for uniform decode, in its own process.

The model forward is compiled with inductor's CUDA graphs and run by a GraphRunner that
captured nothing: each step is planned for its key (padded sizes, bucketed length, so
shapes repeat and nothing recompiles per length) and runs prepare, build and the
write-back eagerly around the compiled forward. An untimed pass over the same steps first
compiles every key the timed pass meets, so no compile lands in the timing. Run by
bench.graph_replay as a subprocess; prints one JSON row per (length, batch).

    python -m bench.compile_baseline --model tiny --sizes 1,8,32,128 --lengths 512,2048
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from bench.graph_replay import (
    WARMUP,
    _summary,
    event_times,
    hbm_bandwidth,
    kv_bytes,
    weight_bytes,
)
from bench.setup import MODELS, fill_requests, make_setup, set_lengths
from graphattn.buckets import BucketPolicy
from graphattn.capture.runner import GraphRunner
from graphattn.state import SchedulerOutput


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sizes", default="1,8,32,128")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    lengths = tuple(int(s) for s in args.lengths.split(","))
    cfg = MODELS[args.model]
    steps = args.steps
    bw = hbm_bandwidth()
    max_len = max(lengths) + 16 + 2 * (WARMUP + steps) + 64
    bounds = tuple(sorted({1 << (x + 16 + 2 * (WARMUP + steps)).bit_length() for x in lengths}))
    policy = BucketPolicy(capture_sizes=sizes,
                          length_boundaries=tuple(b for b in bounds if b < max_len))
    setup = make_setup("cuda", max(sizes), max_len, policy, cfg)
    fill_requests(setup, max(sizes), np.full(max(sizes), 16, np.int32),
                  np.random.default_rng(0))
    compiled = torch.compile(setup.model, mode="reduce-overhead")
    runner = GraphRunner(compiled, setup.state, policy=policy)
    wbytes = weight_bytes(setup.model)
    rng = np.random.default_rng(1)
    from torch._dynamo.utils import counters

    for length in lengths:
        for n in sizes:
            lens = rng.integers(length - 16, length + 16, max(sizes)).astype(np.int32)
            sched = SchedulerOutput(np.arange(n, dtype=np.int32), np.ones(n, np.int32))
            row = {"model": args.model, "mode": "torch_compile_reduce_overhead", "batch": n,
                   "length": length}
            try:
                graphs0 = counters["stats"].get("unique_graphs", 0)
                set_lengths(setup.state, lens)
                t0 = time.perf_counter()
                for _ in range(WARMUP + steps):  # compiles and records every key it meets
                    runner.step(sched)
                torch.cuda.synchronize()
                row["compile_s"] = time.perf_counter() - t0
                graphs1 = counters["stats"].get("unique_graphs", 0)
                set_lengths(setup.state, lens)
                row.update(_summary(event_times(lambda s=sched: runner.step(s), steps)))
                live = float(lens[:n].sum() + n * (WARMUP + steps / 2))
                row["floor_us"] = 1e6 * (wbytes + kv_bytes(cfg, live)) / bw
                row["x_floor"] = row["us_step"] / row["floor_us"]
                row["dynamo_graphs"] = graphs1 - graphs0
                row["timed_recompiles"] = counters["stats"].get("unique_graphs", 0) - graphs1
            except Exception as e:  # noqa: BLE001 - recorded in the table, not hidden
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            print("ROW " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
