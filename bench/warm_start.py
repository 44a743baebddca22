"""Cold vs warm start: capture (compile included) of a compiled runner on the tiny model's
default keys (`BucketPolicy()`), in two fresh processes sharing one compile-cache folder
(torch's inductor FX-graph and AOT caches, under TORCHINDUCTOR_CACHE_DIR; point it at a folder
of your own to keep artifacts across runs).

    python -m bench.warm_start [--device cuda] [--cache-dir DIR] [--out DIR]
                               [--compile-threads N] [--warm-compile-threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

CHILD = """
import json, time, torch
from graphattn import CompileConfig, GraphRunner, RunnerConfig
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState
dev = "{device}"
torch.manual_seed(0)
model = TinyDecoder(TinyConfig()).to(dev)
st = RequestState(8, 256, 16, dev)
model.allocate_caches(8 * st.max_num_blocks_per_req, 16)
runner = GraphRunner(model, st, RunnerConfig(compile=CompileConfig(
    enabled=True, compile_threads={threads})))
keys = runner.dispatcher.all_keys()
t0 = time.perf_counter()
runner.capture(keys[:1], progress=False)
t1 = time.perf_counter()
report = runner.capture(progress=False)
t2 = time.perf_counter()
print(json.dumps({{"seconds": t2 - t0, "first_key_s": t1 - t0, "other_keys_s": t2 - t1,
                  "keys": len(keys), "compiles": runner.compiler.num_compiles}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu",
                    help="torch device")
    ap.add_argument("--cache-dir", default=None,
                    help="inductor's cache folder (default: a fresh temporary one)")
    ap.add_argument("--out", default=None,
                    help="folder for the result files")
    ap.add_argument("--compile-threads", type=int, default=None,
                    help="CompileConfig.compile_threads of both starts (default: inductor's)")
    ap.add_argument("--warm-compile-threads", type=int, default=None,
                    help="CompileConfig.compile_threads of the warm start only (1: no worker "
                         "pool once the cache holds the kernels)")
    args = ap.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="graphattn-inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    rows = []
    for start in tqdm(("cold", "warm"), desc="warm_start", unit="start"):
        threads = args.warm_compile_threads if start == "warm" and \
            args.warm_compile_threads else args.compile_threads
        proc = subprocess.run(
            [sys.executable, "-c", CHILD.format(device=args.device, threads=threads)],
            capture_output=True, text=True, env=env, check=True)
        rows.append({"start": start, "cache_dir": cache, "compile_threads": threads,
                     **json.loads(proc.stdout.strip().splitlines()[-1])})
        tqdm.write(json.dumps(rows[-1]))
    if args.out:
        meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                "device": args.device, "command": "python -m bench.warm_start --device "
                + args.device + (f" --compile-threads {args.compile_threads}"
                                 if args.compile_threads else "")
                + (f" --warm-compile-threads {args.warm_compile_threads}"
                   if args.warm_compile_threads else "")}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        tag = f"_threads{args.compile_threads}" if args.compile_threads else ""
        tag += f"_warm{args.warm_compile_threads}" if args.warm_compile_threads else ""
        Path(args.out, f"warm_start_{args.device}{tag}.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
