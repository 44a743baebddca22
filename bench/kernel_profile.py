"""Per-kernel GPU time of one replayed decode step: our compiled graphs against the
hand-written compiled peer, same weights, or any runner mode of `bench.graph_replay` (the
transformers Llama of the same shape: `hf_compiled_pdl`, `hf_fused_pdl`); a development
aid: run it in its own process, since the profiler leaves CUPTI attached.

    python -m bench.kernel_profile [--model tiny] [--batch 1] [--length 512] [--out DIR]
        [--modes graphattn_compiled_graphs,handwritten_compiled_graph]

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

from bench.graph_replay import RUNNER_MODES, event_times, mode_runner
from bench.handwritten import HandwrittenDecode
from bench.setup import MODELS, fill_requests, make_setup, result_meta, set_lengths
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


def profile_modes(model: str, n: int, length: int,
                  modes: tuple[str, ...]) -> dict[str, tuple]:
    """{mode: (step µs by CUDA events, kernel table, summed kernel µs, idle µs before each
    kernel)} of one decode step of `n` rows near `length` tokens; runner modes first (the
    transformers modes last: they replace the model's caches), then the hand-written peer."""
    cfg, max_len = MODELS[model], length + 256
    policy = BucketPolicy(capture_sizes=(n,), length_boundaries=(max_len,))
    setup = make_setup("cuda", n, max_len, policy, cfg)
    fill_requests(setup, n, np.full(n, 16, np.int32), np.random.default_rng(0))
    lens = np.random.default_rng(1).integers(length - 16, length + 16, n).astype(np.int32)
    sched = SchedulerOutput(np.arange(n, dtype=np.int32), np.ones(n, np.int32))
    results = {}
    for mode in sorted((m for m in modes if m in RUNNER_MODES), key=lambda m: m.startswith("hf")):
        runner = mode_runner(mode, setup, policy)
        runner.capture(progress=False)
        set_lengths(setup.state, lens)

        def step(runner=runner):
            runner.step(sched)

        results[mode] = (float(np.median(event_times(step, 30))), *kernels(step))
        del runner, step
    if "handwritten_compiled_graph" in modes:
        setup.model.caches = []
        setup.runner = None
        torch.cuda.empty_cache()
        hw = HandwrittenDecode(setup.model, n, max_len, "default")
        hw.capture(torch.from_numpy(lens).cuda())
        results["handwritten_compiled_graph"] = (float(np.median(event_times(hw.replay, 30))),
                                                 *kernels(hw.replay))
    return results


def report(results: dict[str, tuple]) -> list[dict]:
    """Print each mode's 25 longest kernel groups and 12 largest gaps; the rows to save."""
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
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--models", default="tiny",
                    help="bench model: tiny or 1b (a Llama-3.2-1B shape)")
    ap.add_argument("--batch", type=int, default=1,
                    help="requests per step")
    ap.add_argument("--length", type=int, default=512,
                    help="context length (tokens per request)")
    ap.add_argument("--modes", default="graphattn_compiled_graphs,handwritten_compiled_graph",
                    help="comma-separated: runner modes of bench.graph_replay "
                         f"({', '.join(RUNNER_MODES)}) and handwritten_compiled_graph")
    ap.add_argument("--out", default=None,
                    help="folder for the result files")
    args = ap.parse_args()
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = sorted(set(modes) - {*RUNNER_MODES, "handwritten_compiled_graph"})
    if unknown:
        ap.error(f"--modes: unknown {unknown}, expected some of {RUNNER_MODES} and "
                 "handwritten_compiled_graph")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    rows = report(profile_modes(args.model, args.batch, args.length, modes))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        tag = "" if set(modes) <= {"graphattn_compiled_graphs", "handwritten_compiled_graph"} \
            else "_" + "_".join(modes)
        meta = result_meta("bench.kernel_profile", args, device="cuda")
        Path(args.out, f"kernel_profile_{args.model}_{args.batch}_{args.length}{tag}.json"
             ).write_text(json.dumps({"meta": meta, "batch": args.batch,
                                      "length": args.length, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
