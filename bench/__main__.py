"""Run the benchmark suite: `python -m bench [--out DIR] [--quick] [--only A,B]`.

Every device: host overhead of planning per stage (prepare, build, plan) for 1..4096
requests, micro-batch planning, and the cost of an NVTX range. On CUDA also the runner
scenarios (mixed prefill+decode, spec decode, many lengths), each against eager with and
without a host read. Writes results.json, results.md and host_planning.png under --out.
Uniform decode side by side with its peers is `python -m bench.graph_replay`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench import host_overhead, profiling_overhead, scenarios
from bench.setup import result_meta

STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("x", "--")]
COLUMNS = ("scenario", "mode", "batch", "us_step", "us_p25", "us_p75", "host_dispatch_us",
           "host_prepare_us", "host_replay_us", "host_eager_us", "host_postprocess_us",
           "prepare_us", "build_us", "plan_us", "syncs_per_step", "graphs", "capture_s",
           "pool_mb", "token_waste", "len_waste", "chunk", "step_modes", "pieces", "error")


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def markdown(rows: list[dict], columns: tuple[str, ...] = COLUMNS) -> str:
    """One table per scenario with the columns it has."""
    out = []
    for scenario in dict.fromkeys(r.get("scenario") for r in rows):
        part = [r for r in rows if r.get("scenario") == scenario]
        cols = [c for c in columns if any(c in r for r in part)]
        out += [f"### {scenario}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in part]
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, device: str) -> None:
    """Host planning µs per stage against the number of requests (this run's rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    host = [r for r in rows if r.get("scenario") == "host_overhead"]
    for (marker, ls), stage in zip(STYLES, ("prepare_us", "build_us", "plan_us"), strict=False):
        pts = sorted((r["batch"], r[stage]) for r in host if stage in r)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=marker, linestyle=ls, label=stage)
    ax.set(xscale="log", yscale="log", xlabel="requests in the step",
           ylabel="host µs per call (median)", title=f"planning on the host ({device}), per stage")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"),
                    help="folder for results.json, results.md and host_planning.png")
    ap.add_argument("--quick", action="store_true", help="fewer steps and sizes")
    ap.add_argument("--only", default=None,
                    help="comma-separated scenario names to run (default: all)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    steps = 30 if args.quick else 200
    sizes = (1, 16, 256) if args.quick else host_overhead.SIZES
    jobs = [("host_overhead", lambda: [
                {"scenario": "host_overhead", "mode": "plan", "batch": r["num_reqs"], **r}
                for r in host_overhead.run("cpu", sizes, iters=steps)]),
            ("ubatch_split", lambda: scenarios.ubatch_split("cpu", steps=steps)),
            ("profiling_overhead", profiling_overhead.run)]
    if cuda:
        jobs += [("mixed", lambda: scenarios.mixed(device, steps=steps // 2)),
                 ("spec_decode", lambda: scenarios.spec_decode(device, steps=steps // 2)),
                 ("many_lengths", lambda: scenarios.many_lengths(device, steps=steps)),
                 ("graph_modes", lambda: scenarios.graph_modes(device, steps=steps // 2))]
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {name for name, _ in jobs}
        if unknown:
            ap.error(f"--only: unknown scenario(s) {sorted(unknown)}; "
                     f"on {device}: {[name for name, _ in jobs]}")
        jobs = [(name, job) for name, job in jobs if name in wanted]
    rows: list[dict] = []
    for name, job in tqdm(jobs, desc="bench", unit="scenario"):
        try:
            rows += job()
        except Exception as e:  # noqa: BLE001 - keep the other scenarios; the failure is shown
            rows.append({"scenario": name, "mode": "failed", "error": f"{type(e).__name__}: {e}"})
            tqdm.write(f"{name} failed: {e!r}")
    meta = {**result_meta("bench", args, device=device), "steps": steps}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = (f"# bench results\n\n{meta['date']}, torch {meta['torch']}, {meta['device']}, "
          f"{steps} steps; µs are medians with p25 / p75, host_*_us the host time of each "
          f"runner stage (median)\n\n{markdown(rows)}")
    (out / "results.md").write_text(md)
    plot(rows, out / "host_planning.png", meta["device"])
    print(md)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'host_planning.png'}")


if __name__ == "__main__":
    main()
