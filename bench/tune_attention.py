"""Time the unified Triton kernel over launch configs on decode shapes (CUDA graph replay,
CUDA events, median), report effective KV bandwidth; the defaults in graphattn.backends.ops
come from this table.

    python scripts/tune_attention.py [--out DIR] [--models tiny,1b] [--shapes 1:2048,128:512]
                                     [--bucket] [--quick] [--layers 8] [--tag NAME]
                                     [--stages 2,3] [--waves 0,1,2,4] [--pdl 0,1]

One graph holds `--layers` calls, each on its own cache (as a model's layers: no call reads
KV another left in L2), and a row's `us` is the graph's time over that count: the launch
gaps between calls, and the split merge's launch, count as they do in a step; one call per
graph (`--layers 1`) is dominated by the graph launch. `waves` 0 is the unsplit kernel;
every config runs with and without programmatic dependent launch (`pdl`).
"""

import argparse
import functools
import itertools
import json
from pathlib import Path

import numpy as np
import torch

from graphattn.backends.launch_config import TritonConfig
from graphattn.backends.triton_launch import triton_attention

SHAPES = {"tiny": (16, 4, 64), "1b": (32, 8, 64)}


def time_us(fns, reps=30):
    """µs per call of a graph calling each of `fns` once (median over `reps` replays)."""
    for fn in fns:
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return float(np.median([1e3 * a.elapsed_time(b) for a, b in ev])) / len(fns)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results",
                    help="folder for the result files")
    ap.add_argument("--models", "--model", default="tiny,1b",
                    help="comma-separated bench models: tiny, 1b (a Llama-3.2-1B shape)")
    ap.add_argument("--shapes", default="1:2048,8:2048,32:2048,128:2048,128:512",
                    help="batch:length pairs")
    ap.add_argument("--bucket", action="store_true",
                    help="bound = bench.graph_replay's length bucket (a power of two above "
                         "the lengths), not the longest length")
    ap.add_argument("--quick", action="store_true", help="4 warps, 2 stages only")
    ap.add_argument("--stages", default="2,3", help="num_stages to try (without --quick)")
    ap.add_argument("--waves", default="0,1,2,4", help="split targets to try (0: no split)")
    ap.add_argument("--pdl", default="0,1", help="pdl off (0) and/or on (1)")
    ap.add_argument("--layers", type=int, default=8, help="calls (own caches) per graph")
    ap.add_argument("--tag", default="", help="writes tune_attention{_tag}.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    rng = np.random.default_rng(0)
    rows = []
    waves = tuple(int(w) for w in args.waves.split(","))
    pdl = tuple(bool(int(x)) for x in args.pdl.split(","))
    grid = ((32, 64, 128), (4,), (2,), waves, pdl) if args.quick else (
        (32, 64, 128), (4, 8), tuple(int(x) for x in args.stages.split(",")), waves, pdl)
    configs = [TritonConfig(*c) for c in itertools.product(*grid)]
    shapes = [tuple(int(x) for x in bl.split(":")) for bl in args.shapes.split(",")]
    for name in args.models.split(","):
        h, hkv, d = SHAPES[name]
        for batch, length in shapes:
            bs = 16
            nblk = -(-(length + 16) // bs)
            caches = [tuple(torch.randn(batch * nblk + 1, bs, hkv, d, device="cuda",
                                        dtype=torch.bfloat16) for _ in range(2))
                      for _ in range(args.layers)]
            bt = torch.from_numpy(rng.permutation(batch * nblk).astype(np.int32)
                                  .reshape(batch, nblk)).cuda()
            lens = rng.integers(length - 16, length + 16, batch).astype(np.int32)
            seq = torch.from_numpy(lens).cuda()
            qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)
            kv = float(lens.sum()) * hkv * d * 2 * 2
            best = None
            for cfg in configs:
                if cfg.waves > 1 and batch * hkv >= 132 * cfg.waves:
                    continue
                try:
                    bound = 1 << (length + 86).bit_length() if args.bucket else nblk * bs
                    us = time_us([functools.partial(triton_attention, q, kc, vc, qsl, seq,
                                                    bt, d ** -0.5, 1, bound, 0, 0.0, None, cfg)
                                  for kc, vc in caches])
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(name, batch, cfg, "failed", type(e).__name__)
                    continue
                row = {"model": name, "batch": batch, "length": length, **{
                    f: getattr(cfg, f) for f in cfg.__slots__}, "us": us,
                    "kv_tbps": kv / (us * 1e-6) / 1e12}
                rows.append(row)
                if best is None or us < best["us"]:
                    best = row
            print("best", best, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = f"tune_attention{'_' + args.tag if args.tag else ''}.json"
    Path(args.out, name).write_text(json.dumps(rows, indent=1))
    # the config with the best worst-case ratio to each shape's best
    bests = {}
    for r in rows:
        k = (r["model"], r["batch"], r["length"])
        bests[k] = min(bests.get(k, 1e9), r["us"])
    score = {}
    for r in rows:
        c = (r["block_n"], r["num_warps"], r["num_stages"], r["waves"], r["pdl"])
        k = (r["model"], r["batch"], r["length"])
        score.setdefault(c, []).append(r["us"] / bests[k])
    full = {c: max(v) for c, v in score.items() if len(v) == len(bests)}
    for c, v in sorted(full.items(), key=lambda x: x[1])[:8]:
        print("config", c, "worst ratio to best", round(v, 3))


if __name__ == "__main__":
    main()
