"""Run the benchmark suite: `python -m bench [--out DIR] [--quick]`.

On CUDA: every scenario with its baselines. On CPU: the host-overhead parts
(prepare/build per request count, ubatch planning). Writes results.json,
results.md and us_per_step.png under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch

from bench import graph_replay, host_overhead, profiling_overhead, scenarios

COLUMNS = ("scenario", "mode", "batch", "us_step", "host_us", "host_us_p99", "vs_floor",
           "syncs_per_step", "graphs", "capture_s", "pool_mb", "token_waste", "len_waste",
           "gpu_idle_frac")


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def markdown(rows: list[dict], columns: tuple[str, ...] = COLUMNS) -> str:
    cols = [c for c in columns if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    decode = [r for r in rows if r.get("scenario") == "uniform_decode" and "us_step" in r]
    for mode in dict.fromkeys(r["mode"] for r in decode):
        pts = sorted((r["batch"], r["us_step"]) for r in decode if r["mode"] == mode)
        ax.plot(*zip(*pts, strict=True), marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (requests)")
    ax.set_ylabel("µs / step")
    ax.set_title("uniform decode, TinyDecoder 8x1024 bf16")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--quick", action="store_true", help="fewer steps and sizes")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    steps = 50 if args.quick else 200
    from tqdm import tqdm

    jobs = [("host_overhead", lambda: [{"scenario": "host_overhead", "mode": "prepare+build",
                                        "batch": r["num_reqs"], "us_step": r["total_us"],
                                        "prepare_us": r["prepare_us"], "build_us": r["build_us"],
                                        "plan_us": r["plan_us"]}
                                       for r in host_overhead.run("cpu")]),
            ("ubatch_split", lambda: scenarios.ubatch_split("cpu", steps=steps)),
            ("profiling_overhead", profiling_overhead.run)]
    info: dict = {}
    if cuda:
        sizes = (1, 8, 32) if args.quick else (1, 8, 32, 128)

        def decode():
            rows, i = graph_replay.run(device, sizes, steps)
            info.update(i)
            return [{**r, **i} for r in rows]

        # uniform_decode (with its torch.compile baseline) last: dynamo state cannot leak
        # into the other scenarios
        jobs += [("mixed", lambda: scenarios.mixed(device, steps=steps // 2)),
                 ("spec_decode", lambda: scenarios.spec_decode(device, steps=steps // 2)),
                 ("many_lengths", lambda: scenarios.many_lengths(device, steps=steps)),
                 ("uniform_decode", decode)]
    rows: list[dict] = []
    for name, job in tqdm(jobs, desc="bench", unit="scenario"):
        tqdm.write(f"running {name}")
        try:
            rows += job()
        except Exception as e:  # keep the other scenarios; the failure is in the table
            rows.append({"scenario": name, "mode": "failed", "error": f"{type(e).__name__}: {e}"})
            tqdm.write(f"{name} failed: {e!r}")
        (out / "results.partial.json").write_text(json.dumps(rows, indent=1))
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "steps": steps, **info}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(rows)
    extra = [r for r in rows if "error" in r or "compile_s" in r]
    md = f"{json.dumps(meta)}\n\n{table}\n"
    if extra:
        md += "\n" + markdown(extra, ("scenario", "mode", "batch", "compile_s", "dynamo_graphs",
                                      "timed_recompiles", "skipped_cudagraphs", "error")) + "\n"
    (out / "results.md").write_text(md)
    (out / "results.partial.json").unlink(missing_ok=True)
    if cuda:
        plot(rows, out / "us_per_step.png")
    print(md)


if __name__ == "__main__":
    main()
