"""Per-kernel GPU time of one replayed decode step: our compiled graphs against the
hand-written compiled peer, same weights (a development aid; run it in its own process,
since the profiler leaves CUPTI attached).

    python -m bench.kernel_profile [--model tiny] [--batch 1] [--length 512] [--out DIR]

Prints, per mode, the kernels of one step grouped by name: launches per step, µs per step,
and the sum of kernel time against the step's CUDA-event time (the gap is launch/idle time
between graph nodes), then which kernels that idle time precedes.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.graph_replay import event_times
from bench.handwritten import HandwrittenDecode
from bench.setup import MODELS, fill_requests, make_setup, set_lengths
from graphattn.buckets import BucketPolicy
from graphattn.state import SchedulerOutput

STEPS = 20


def gaps_before(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """{name: summed idle µs between the previous device op's end and this one's start}."""
    out: dict[str, float] = defaultdict(float)
    busy_until = None
    for start, end, name in sorted(spans):
        if busy_until is not None:
            out[name[:110]] += max(0.0, start - busy_until)
        busy_until = end if busy_until is None else max(busy_until, end)
    return dict(out)


def kernels(fn) -> tuple[dict[str, tuple[float, float]], float, dict[str, float]]:
    """{kernel name: (launches per step, µs per step)}, the summed µs per step and
    {kernel name: idle µs per step just before it} (where the gaps between kernels sit)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            fn()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name][0] += 1
            agg[e.name][1] += e.device_time
            spans.append((e.time_range.start, e.time_range.end, e.name))
    out = {k[:110]: (n / STEPS, us / STEPS) for k, (n, us) in agg.items()}
    gaps = {k: us / STEPS for k, us in gaps_before(spans).items()}
    return out, sum(us for _, us in out.values()), gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--models", default="tiny",
                    help="bench model: tiny or 1b (a Llama-3.2-1B shape)")
    ap.add_argument("--batch", type=int, default=1,
                    help="requests per step")
    ap.add_argument("--length", type=int, default=512,
                    help="context length (tokens per request)")
    ap.add_argument("--out", default=None,
                    help="folder for the result files")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    cfg, n, length = MODELS[args.model], args.batch, args.length
    max_len = length + 256
    policy = BucketPolicy(capture_sizes=(n,), length_boundaries=(max_len,))
    setup = make_setup("cuda", n, max_len, policy, cfg, compile=True)
    fill_requests(setup, n, np.full(n, 16, np.int32), np.random.default_rng(0))
    setup.runner.capture(progress=False)
    lens = np.random.default_rng(1).integers(length - 16, length + 16, n).astype(np.int32)
    sched = SchedulerOutput(np.arange(n, dtype=np.int32), np.ones(n, np.int32))
    results = {}

    def ours():
        setup.runner.step(sched)

    set_lengths(setup.state, lens)
    results["graphattn_compiled_graphs"] = (float(np.median(event_times(ours, 30))),
                                            *kernels(ours))
    model = setup.model
    model.caches = []
    setup.runner = None
    torch.cuda.empty_cache()
    hw = HandwrittenDecode(model, n, max_len, "default")
    hw.capture(torch.from_numpy(lens).cuda())
    results["handwritten_compiled_graph"] = (float(np.median(event_times(hw.replay, 30))),
                                             *kernels(hw.replay))
    rows = []
    for mode, (step_us, table, total, gaps) in results.items():
        print(f"\n## {mode}: step {step_us:.1f} µs (CUDA events), kernels {total:.1f} µs, "
              f"{sum(c for c, _ in table.values()):.0f} launches per step")
        for name, (count, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:25]:
            print(f"{us:8.1f} µs {count:5.1f}x  {name}")
        print(f"idle before each kernel, µs per step (profiled: {sum(gaps.values()):.1f} in all)")
        for name, us in sorted(gaps.items(), key=lambda kv: -kv[1])[:12]:
            print(f"{us:8.1f} µs  {name}")
        rows.append({"mode": mode, "step_us": step_us, "kernel_us": total,
                     "kernels": {k: list(v) for k, v in table.items()}, "gaps_before": gaps})
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"kernel_profile_{args.model}_{n}_{length}.json").write_text(
            json.dumps({"torch": torch.__version__, "batch": n, "length": length,
                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
