"""Cost of one StageProfiler range with no profiler attached (and, for scale, recording).

    python -m bench.profiling_overhead
"""

from __future__ import annotations

import time

import torch

from graphattn.capture.profiling import StageProfiler


def ns_per_range(prof: StageProfiler, n: int = 20000) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        with prof.range("replay", "reqs=8 tokens=8 len<=64 decode q=1"):
            pass
    return (time.perf_counter_ns() - t0) / n


def run() -> list[dict]:
    rows = [{"scenario": "profiling_overhead", "mode": mode, "us_step": ns_per_range(p) / 1000}
            for mode, p in (("disabled", StageProfiler(enabled=False)),
                            ("nvtx+labels, no profiler", StageProfiler()),
                            ("nvtx only", StageProfiler(torch_labels=False)))]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        rows.append({"scenario": "profiling_overhead", "mode": "torch.profiler recording",
                     "us_step": ns_per_range(StageProfiler(), 2000) / 1000})
    return rows


def main() -> None:
    for r in run():
        print(f"{r['mode']:<28} {1000 * r['us_step']:8.0f} ns per range")


if __name__ == "__main__":
    main()
