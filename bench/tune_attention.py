"""Time the unified Triton kernel over launch configs on decode shapes (CUDA graph replay,
CUDA events, median), report effective KV bandwidth; the defaults in graphattn.backends.ops
come from this table.

    python -m bench.tune_attention [--out DIR] [--models tiny,1b] [--shapes 1:2048,128:512]
                                   [--bucket] [--quick] [--layers 8] [--tag NAME]
                                   [--block-n 32,64,128] [--stages 2,3] [--waves 0,1,2,4]
                                   [--pdl 0,1] [--merge 0,1] [--kv-dtype fp8_e4m3]
                                   [--suffix 2048] [--cascade 2048]

One graph holds `--layers` calls, each on its own cache (as a model's layers: no call reads
KV another left in L2), and a row's `us` is the graph's time over that count: the launch
gaps between calls, and the split merge's launch, count as they do in a step; one call per
graph (`--layers 1`) is dominated by the graph launch. `waves` 0 is the unsplit kernel;
every config runs with and without programmatic dependent launch (`pdl`), and split ones
with their splits merged by the merge kernel (`merge` off, the library's default) or, with
`--merge 0,1`, also inside the launch. Graphs are captured after a warm-up on their capture
stream, as the runner captures, so a merging launch records its in-launch merge.

`--kv-dtype fp8_e4m3`: the caches hold float8 e4m3 (unit scales), a row's bandwidth counts
one byte an element. `--suffix P`: the suffix pass of shared-prefix attention: each row's
length is P plus 64-512 tokens (the shape's length is ignored) and it reads its keys from P
on (`kv_start`), as `triton_cascade` launches it after the prefix pass; the bandwidth counts
the suffix keys. `--cascade P`: the whole shared-prefix op (`triton_cascade`) on those
rows, all of which share their first P tokens' blocks; the configs are its prefix pass's
(`launch_shared_prefix`), the bandwidth counts the prefix once and every suffix.
"""

import argparse
import functools
import itertools
import json
from pathlib import Path

import numpy as np
import torch

from bench.timing import capture_warm
from graphattn.backends.launch_config import TritonConfig
from graphattn.backends.reference import cache_dtype
from graphattn.backends.triton_launch import triton_attention, triton_cascade

SHAPES = {"tiny": (16, 4, 64), "1b": (32, 8, 64)}


def time_us(fns, reps=30):
    """µs per call of a graph calling each of `fns` once (median over `reps` replays)."""
    g = capture_warm(lambda: [fn() for fn in fns])
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return float(np.median([1e3 * a.elapsed_time(b) for a, b in ev])) / len(fns)


def _inputs(name: str, batch: int, length: int, layers: int, kv_dtype: torch.dtype,
            suffix: int, rng: np.random.Generator, cascade: bool = False) -> dict:
    """Caches (one per layer), block table, lengths, queries and the KV bytes one call
    reads, for `batch` decode rows of bench model `name`; `cascade`: the rows share their
    first `suffix` tokens' blocks."""
    h, hkv, d = SHAPES[name]
    bs = 16
    lens = (suffix + rng.integers(64, 513, batch) if suffix
            else rng.integers(length - 16, length + 16, batch)).astype(np.int32)
    nblk = -(-(int(lens.max()) + 16) // bs)
    caches = [tuple(torch.randn(batch * nblk + 1, bs, hkv, d, device="cuda",
                                dtype=torch.bfloat16).to(kv_dtype) for _ in range(2))
              for _ in range(layers)]
    bt = torch.from_numpy(rng.permutation(batch * nblk).astype(np.int32)
                          .reshape(batch, nblk)).cuda()
    if cascade:
        bt[:, : suffix // bs] = bt[0, : suffix // bs]
    read = float((lens - suffix).sum() + (suffix if cascade else 0)) * hkv * d * 2 \
        * caches[0][0].element_size()
    return {"caches": caches, "bt": bt, "lens": lens, "nblk": nblk, "bs": bs, "kv": read,
            "seq": torch.from_numpy(lens).cuda(), "d": d,
            "qsl": torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
            "q": torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16),
            "kv_start": (torch.full((batch,), suffix, dtype=torch.int32, device="cuda")
                         if suffix else None)}


def _time_config(x: dict, cfg: TritonConfig, bound: int, cascade: int = 0) -> float:
    """µs per call of `cfg` over the inputs `x` of `_inputs` (`cascade` > 0: the
    shared-prefix op with that prefix, `cfg` its prefix pass's)."""
    if cascade:
        return time_us([functools.partial(triton_cascade, x["q"], kc, vc, x["qsl"], x["seq"],
                                          x["bt"], x["d"] ** -0.5, 1, bound, x["kv_start"],
                                          cascade, 0, 0.0, None, prefix_config=cfg)
                        for kc, vc in x["caches"]])
    return time_us([functools.partial(triton_attention, x["q"], kc, vc, x["qsl"], x["seq"],
                                      x["bt"], x["d"] ** -0.5, 1, bound, 0, 0.0, None, cfg,
                                      kv_start=x["kv_start"])
                    for kc, vc in x["caches"]])


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
    ap.add_argument("--block-n", default="32,64,128", help="keys per tile to try")
    ap.add_argument("--stages", default="2,3", help="num_stages to try (without --quick)")
    ap.add_argument("--waves", default="0,1,2,4", help="split targets to try (0: no split)")
    ap.add_argument("--pdl", default="0,1", help="pdl off (0) and/or on (1)")
    ap.add_argument("--merge", default="0",
                    help="split launches merge their splits through the merge kernel (0, the "
                         "library's default) and/or themselves (1)")
    ap.add_argument("--max-registers", default="0",
                    help="registers a thread may take (TritonConfig.max_registers; 0: the "
                         "compiler's choice)")
    ap.add_argument("--prefetch-pages", default="0",
                    help="without (0) and/or with (1) the block table prefetched a tile ahead "
                         "(TritonConfig.prefetch_pages)")
    ap.add_argument("--layers", type=int, default=8, help="calls (own caches) per graph")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "fp8_e4m3"),
                    help="cache dtype")
    ap.add_argument("--suffix", type=int, default=0,
                    help="P > 0: the suffix pass after a P-token shared prefix")
    ap.add_argument("--cascade", type=int, default=0,
                    help="P > 0: the whole shared-prefix op, rows sharing a P-token prefix")
    ap.add_argument("--tag", default="", help="writes tune_attention{_tag}.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    return args


def main():
    args = _args()
    rng = np.random.default_rng(0)
    rows = []
    ints = lambda text: tuple(int(v) for v in text.split(","))  # noqa: E731
    pdl, merge = (tuple(bool(v) for v in ints(text)) for text in (args.pdl, args.merge))
    grid = (ints(args.block_n), (4,), (2,), ints(args.waves), pdl) if args.quick else (
        ints(args.block_n), (4, 8), ints(args.stages), ints(args.waves), pdl)
    configs = [TritonConfig(*c[:5], merge=c[5], max_registers=c[6], prefetch_pages=bool(c[7]))
               for c in itertools.product(*grid, merge, ints(args.max_registers),
                                          ints(args.prefetch_pages))
               if c[5] or c[3] != 0]  # merging is moot where nothing splits
    kv_dtype = cache_dtype(None if args.kv_dtype == "bfloat16" else args.kv_dtype,
                           torch.bfloat16)
    for name in args.models.split(","):
        for batch, length in (ints(bl.replace(":", ",")) for bl in args.shapes.split(",")):
            x = _inputs(name, batch, length, args.layers, kv_dtype,
                        args.suffix or args.cascade, rng, bool(args.cascade))
            bound = (1 << (int(x["lens"].max()) + 70).bit_length() if args.bucket
                     else x["nblk"] * x["bs"])
            best = None
            for cfg in configs:
                if (cfg.waves > 1 and batch * SHAPES[name][1] >= 132 * cfg.waves
                        and not args.cascade):
                    continue
                try:
                    us = _time_config(x, cfg, bound, args.cascade)
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(name, batch, cfg, "failed", type(e).__name__)
                    continue
                row = {"model": name, "batch": batch, "length": length,
                       "kv_dtype": args.kv_dtype, "suffix": args.suffix,
                       "cascade": args.cascade,
                       **{f: getattr(cfg, f) for f in cfg.__slots__}, "us": us,
                       "kv_tbps": x["kv"] / (us * 1e-6) / 1e12}
                rows.append(row)
                if best is None or us < best["us"]:
                    best = row
            print("best", best, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = f"tune_attention{'_' + args.tag if args.tag else ''}.json"
    Path(args.out, name).write_text(json.dumps(rows, indent=1))
    _print_robust(rows)


def _print_robust(rows: list[dict]) -> None:
    """The 8 configs with the best worst-case ratio to each shape's best."""
    bests = {}
    for r in rows:
        k = (r["model"], r["batch"], r["length"])
        bests[k] = min(bests.get(k, 1e9), r["us"])
    score = {}
    for r in rows:
        c = (r["block_n"], r["num_warps"], r["num_stages"], r["waves"], r["pdl"], r["merge"],
             r["max_registers"], r["prefetch_pages"])
        k = (r["model"], r["batch"], r["length"])
        score.setdefault(c, []).append(r["us"] / bests[k])
    full = {c: max(v) for c, v in score.items() if len(v) == len(bests)}
    for c, v in sorted(full.items(), key=lambda x: x[1])[:8]:
        print("config", c, "worst ratio to best", round(v, 3))


if __name__ == "__main__":
    main()
