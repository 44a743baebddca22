"""Cold vs warm start: capture (compile included) of a compiled runner, in fresh processes
sharing one compile-cache folder (torch's inductor FX-graph and AOT caches, under
TORCHINDUCTOR_CACHE_DIR; point it at a folder of your own to keep artifacts across runs).

Three starts, each a row: "first" (the installation's first start: Python compiles torch's
sources and caches their bytecode, as installing a package does; an empty compile cache of
its own), "cold" (bytecode cached, empty compile cache) and "warm" (both cached).

The keys are those of `bench.startup`: a uniform decode key for every default capture size
up to ``--max-reqs`` and mixed keys of ``--mixed`` tokens, one length bucket of
``--max-len``; the model is one of `bench.setup.MODELS`, bf16 on CUDA.

    python -m bench.warm_start [--model tiny] [--max-reqs 8] [--device cuda] [--cache-dir DIR]
                               [--dynamic] [--artifacts] [--regions blocks]
                               [--compile-threads N] [--warm-compile-threads N]
                               [--starts first,cold,warm] [--profile] [--out DIR]

``--dynamic`` compiles with `CompileConfig(dynamic=True)` (one compile shared by the batch
shapes); ``--artifacts`` keeps the compiled step functions in the cache folder too
(`CompileConfig.artifact_dir`), so the warm start loads them instead of tracing;
``--regions blocks`` compiles the decoder layers once, shared (`CompileConfig.regions`). Results
go to ``warm_start_<device>_<model>_<max-reqs>[_dynamic][_aot][_blocks][_threadsN][_warmN]
.json``, a row per start, whose ``key_s`` lists each key's (requests, tokens, uniform decode,
seconds of its capture with its warm-up runs; what the row's total adds is the pool
measurement after each key) and whose ``triton_first_key`` / ``triton_all_keys`` count the
Triton JIT compiles of graphattn's kernels by name, [count, seconds] (`triton_compiles`: a
compile that Triton's disk cache serves takes milliseconds); with ``--profile`` each start
runs under cProfile and the functions with the most cumulative time, with dynamo's
compile-phase times, go to the same name ending ``_profile.txt``. ``--starts`` runs some of
the starts only, e.g. ``--starts warm --profile --cache-dir DIR`` profiles a warm start from
the cache an earlier run left in DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.setup import MODELS, result_meta
from graphattn.config import REGIONS

BLOCK = 16
STARTS = ("first", "cold", "warm")


@contextlib.contextmanager
def triton_compiles() -> Iterator[dict[str, list[float]]]:
    """Compiles of Triton JIT functions launched in the block (graphattn's kernels; inductor
    compiles its own apart), by kernel name: [count, seconds]. A compile that Triton's
    on-disk cache serves counts too, in milliseconds. Empty without Triton's JIT hooks."""
    found: dict[str, list[float]] = {}
    try:
        from triton import knobs
    except ImportError:
        knobs = None
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        yield found
        return
    started: dict[str, float] = {}

    def before(*, key: object, fn: object, **_: object) -> bool:
        started[f"{fn.name}{key}"] = time.perf_counter()
        return False  # compile it

    def after(*, key: object, fn: object, **_: object) -> bool:
        seconds = time.perf_counter() - started.pop(f"{fn.name}{key}", time.perf_counter())
        entry = found.setdefault(fn.name, [0, 0.0])
        entry[0] += 1
        entry[1] = round(entry[1] + seconds, 4)
        return False

    runtime = knobs.runtime
    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
    try:
        yield found
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def child(args: argparse.Namespace) -> None:
    """One start: build the runner, capture the first key, then the others; print a JSON
    row (stdout) and dynamo's compile times (stderr)."""
    from bench.startup import startup_policy
    from graphattn import CompileConfig, GraphRunner, RequestState, RunnerConfig
    from graphattn.models.tiny import TinyDecoder

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = TinyDecoder(MODELS[args.model]).to(dtype)
    st = RequestState(args.max_reqs, args.max_len, BLOCK, args.device)
    model.allocate_caches(args.max_reqs * st.max_num_blocks_per_req, BLOCK)
    policy = startup_policy(args.max_reqs, args.max_len, args.mixed)
    artifacts = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"], "aot") if args.artifacts else None
    runner = GraphRunner(model, st, RunnerConfig(policy=policy, compile=CompileConfig(
        enabled=True, compile_threads=args.compile_threads, dynamic=args.dynamic,
        artifact_dir=artifacts, regions=args.regions)))
    keys = runner.dispatcher.all_keys()
    with triton_compiles() as jit:
        t0 = time.perf_counter()
        first = runner.capture(keys[:1], progress=False)
        t1 = time.perf_counter()
        first_jit = {name: list(c) for name, c in jit.items()}
        rest = runner.capture(progress=False)
        t2 = time.perf_counter()
    compilers = runner.device_step.compilers()
    per_key = [[k.num_reqs_padded, k.num_tokens_padded, k.uniform_decode, round(s, 4)]
               for k, s in zip(first.keys + rest.keys, first.key_seconds + rest.key_seconds,
                               strict=True)]
    print(json.dumps({"seconds": t2 - t0, "first_key_s": t1 - t0, "other_keys_s": t2 - t1,
                      "keys": len(keys), "compiles": runner.compiler.num_compiles,
                      "all_compiles": sum(c.num_compiles for c in compilers),
                      "loaded": sum(c.num_loaded for c in compilers), "key_s": per_key,
                      "triton_first_key": first_jit, "triton_all_keys": jit}))
    print(torch._dynamo.utils.compile_times(repr="str"), file=sys.stderr)


def start(args: argparse.Namespace, threads: int | None, env: dict[str, str],
          prof: Path | None) -> tuple[dict, str]:
    """Run one start in a fresh process: its JSON row and its stderr."""
    opts = ["--child", "--model", args.model, "--max-reqs", str(args.max_reqs), "--max-len",
            str(args.max_len), "--mixed", args.mixed, "--device", args.device]
    opts += ["--compile-threads", str(threads)] if threads else []
    opts += ["--dynamic"] if args.dynamic else []
    opts += ["--artifacts"] if args.artifacts else []
    opts += ["--regions", args.regions]
    cmd = [sys.executable] + (["-m", "cProfile", "-o", str(prof)] if prof else [])
    proc = subprocess.run(cmd + ["-m", "bench.warm_start", *opts], capture_output=True,
                          text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"the {args.model} start failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def profile_text(name: str, prof: Path, stderr: str) -> str:
    """The start's 40 functions of most cumulative time and its compile-phase times."""
    buf = io.StringIO()
    pstats.Stats(str(prof), stream=buf).sort_stats("cumulative").print_stats(40)
    phases = stderr[stderr.rfind("TorchDynamo compilation metrics"):] \
        if "TorchDynamo compilation metrics" in stderr else ""
    return f"## {name} start\n{buf.getvalue()}\n{phases}\n"


def starts(text: str) -> str:
    """``--starts``: names of `STARTS`, comma-separated."""
    names = text.split(",")
    if not all(n in STARTS for n in names):
        raise argparse.ArgumentTypeError(f"expected names of {STARTS}, got {text!r}")
    return text


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS), help="bench model")
    ap.add_argument("--max-reqs", type=int, default=8, help="the state's max_num_reqs")
    ap.add_argument("--max-len", type=int, default=2048, help="the state's max_model_len")
    ap.add_argument("--mixed", default="512,2048", help="comma-separated mixed key sizes")
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--cache-dir", default=None,
                    help="inductor's cache folder (default: a fresh temporary one)")
    ap.add_argument("--dynamic", action="store_true",
                    help="CompileConfig.dynamic: one compile shared by the batch shapes")
    ap.add_argument("--artifacts", action="store_true",
                    help="CompileConfig.artifact_dir: the warm start loads the compiled step")
    ap.add_argument("--regions", default="step", choices=REGIONS,
                    help="CompileConfig.regions: the whole step, or the repeated blocks")
    ap.add_argument("--compile-threads", type=int, default=None,
                    help="CompileConfig.compile_threads of both starts (default: the runner's)")
    ap.add_argument("--warm-compile-threads", type=int, default=None,
                    help="CompileConfig.compile_threads of the warm start only")
    ap.add_argument("--starts", type=starts, default=",".join(STARTS),
                    help=f"comma-separated starts to run, in order (default {','.join(STARTS)})")
    ap.add_argument("--profile", action="store_true",
                    help="run each start under cProfile (the result name + _profile.txt)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="folder for the result files")
    return ap.parse_args()


def main() -> None:
    args = parse()
    if args.child:
        return child(args)
    cache = args.cache_dir or tempfile.mkdtemp(prefix="graphattn-inductor-")
    # Python's bytecode is cached as an installed package's is (where site-packages is
    # read-only or PYTHONDONTWRITEBYTECODE is set, each process would recompile torch's
    # sources): the first start writes it, with a compile cache of its own
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = os.environ.get("PYTHONPYCACHEPREFIX",
                                                str(Path(cache, "pycache")))
    rows, texts = [], []
    with tempfile.TemporaryDirectory(prefix="graphattn-first-") as first:
        for name in tqdm(args.starts.split(","), desc="warm_start", unit="start"):
            threads = args.warm_compile_threads if name == "warm" and \
                args.warm_compile_threads else args.compile_threads
            prof = Path(cache, f"{name}.prof") if args.profile and name != "first" else None
            env["TORCHINDUCTOR_CACHE_DIR"] = first if name == "first" else cache
            row, stderr = start(args, threads, env, prof)
            rows.append({"start": name, "compile_threads": threads, **row})
            texts += [profile_text(name, prof, stderr)] if prof else []
            tqdm.write(json.dumps(rows[-1]))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = result_meta("bench.warm_start", argparse.Namespace(
            **{k: v for k, v in vars(args).items() if k not in ("cache_dir", "child")}))
        tag = "_dynamic" if args.dynamic else ""
        tag += "_aot" if args.artifacts else ""
        tag += "_blocks" if args.regions == "blocks" else ""
        tag += f"_threads{args.compile_threads}" if args.compile_threads else ""
        tag += f"_warm{args.warm_compile_threads}" if args.warm_compile_threads else ""
        stem = f"warm_start_{args.device}_{args.model}_{args.max_reqs}{tag}"
        Path(args.out, f"{stem}.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1))
        if texts:
            Path(args.out, f"{stem}_profile.txt").write_text("\n".join(texts))


if __name__ == "__main__":
    main()
