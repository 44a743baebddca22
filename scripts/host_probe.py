"""Host time of graph steps after each earlier suite scenario in the same process.

    python scripts/host_probe.py none|mixed|spec|profiling [steps]

The suite run measured graph steps whose step() took as long as the GPU step,
a standalone decode run 130-170 µs: run once per argument (each in a fresh
process) to see which earlier scenario leaves the host waiting.
"""

import sys

import torch

from bench import graph_replay, profiling_overhead, scenarios

before = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
device = "cuda" if torch.cuda.is_available() else "cpu"
if before == "mixed":
    scenarios.mixed(device, steps=steps // 2)
elif before == "spec":
    scenarios.spec_decode(device, steps=steps // 2)
elif before == "profiling":
    profiling_overhead.run()
rows, _ = graph_replay.run(device, (1, 128), steps, compile_baseline=False)
for r in rows:
    if r["mode"] in ("graphs", "replay_floor"):
        print(before, r["mode"], r["batch"], round(r["us_step"]), round(r.get("host_us", 0)),
              round(r.get("host_us_p99", 0)), torch.__version__)
