"""Startup: capture seconds and graph-pool MiB per key, with the LM head only at the rows that
are sampled ("used", the default) or at every token ("all", a forward that ignores
logits_indices), beside the model's eager first step and the pool that
`GraphRunner.estimate_graph_memory` predicted before capture (and the seconds it took).

Eager-model graphs of the tiny and 1B shapes (`bench.setup.MODELS`), and of a transformers
Llama of the 1B shape through `HFCausalLM` ("hf-1b"); keys: uniform decodes of every default
capture size up to `--max-reqs` and mixed keys of `--mixed` tokens, one length bucket.

With `--lazy`, a runner with `RunnerConfig(lazy_capture=True)` instead: per decode size,
the first step that needs the new key (eager at its padded shapes, then its capture) against
one eager step of the same batch plus that capture, and the replayed step after it.

    python -m bench.startup [--models tiny,1b,hf-1b] [--max-reqs 64] [--lazy] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.setup import MODELS, hf_llama, result_meta
from graphattn import BucketPolicy, GraphRunner, RequestState, RunnerConfig, SchedulerOutput
from graphattn.buckets import default_capture_sizes
from graphattn.models.tiny import TinyDecoder

BLOCK = 16


def build(model_name: str, device: str, dtype: torch.dtype) -> tuple[object, str]:
    """The forward of `model_name` and a label of its kind."""
    torch.manual_seed(0)
    if model_name != "hf-1b":
        with torch.device(device):
            return TinyDecoder(MODELS[model_name]).to(dtype), "TinyDecoder"
    return hf_llama(device, dtype), "HFCausalLM(LlamaForCausalLM)"


def startup_policy(max_reqs: int, max_len: int, mixed: str | tuple[int, ...] = ()
                   ) -> BucketPolicy:
    """The keys a start captures: a uniform decode key per default capture size up to
    `max_reqs`, mixed keys of `mixed` tokens (comma-separated or a tuple), one length bucket."""
    if isinstance(mixed, str):
        mixed = tuple(int(t) for t in mixed.split(",") if t)
    return BucketPolicy(capture_sizes=default_capture_sizes(max_reqs),
                        length_boundaries=(max_len,), mixed_token_sizes=tuple(mixed))


def measure(forward: object, device: str, max_reqs: int, max_len: int, mixed: tuple[int, ...],
            logits: str) -> dict:
    """Capture every key (`CaptureReport`: seconds and pool MiB after each), and time the
    eager first step of a `max(mixed)`-token prefill."""
    st = RequestState(max_reqs, max_len, BLOCK, device)
    policy = startup_policy(max_reqs, max_len, mixed)
    names = None if logits == "used" else ("input_ids", "positions")
    runner = GraphRunner(forward, st, RunnerConfig(policy=policy, static_input_names=names))
    t0 = time.perf_counter()
    estimate = runner.estimate_graph_memory().total_bytes
    estimate_s = time.perf_counter() - t0
    report = runner.capture(progress=True)
    keys = report.keys
    rows = [{"key": str(k), "seconds": t, "pool_mib": b / 2**20} for k, t, b in zip(
        keys, report.key_seconds, report.key_pool_bytes, strict=True)]
    runner.add_request("p", np.arange(max(mixed)) % 1000)
    sched = SchedulerOutput(np.array([0]), np.array([max(mixed)]))
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.step(sched, force_eager=True).sampled_host.wait()
    eager_s = time.perf_counter() - t0
    return {"logits": logits, "keys": len(keys), "capture_s": report.seconds,
            "pool_mib": report.pool_bytes / 2**20, "estimate_mib": estimate / 2**20,
            "estimate_s": estimate_s, "eager_first_step_s": eager_s, "per_key": rows}


def _timed(runner: GraphRunner, sched: SchedulerOutput, force_eager: bool = False) -> float:
    """Seconds of one step, from its call to its sampled tokens on the host."""
    t0 = time.perf_counter()
    runner.step(sched, force_eager=force_eager).sampled_host.wait()
    return time.perf_counter() - t0


def measure_lazy(forward: object, device: str, max_reqs: int, max_len: int,
                 sizes: tuple[int, ...]) -> list[dict]:
    """Per decode size: the first step of its key with lazy capture on (the key's eager step
    and capture), one eager step of the same batch, the capture's own seconds, and the
    replayed step after. Twice, on two runners: the first pass pays the process's one-time
    costs (Triton compiling each kernel specialization, cuBLAS heuristics), which any start
    pays once, eager or captured; the rows are the second pass's."""
    for _ in range(2):
        rows = _lazy_pass(forward, device, max_reqs, max_len, sizes)
    return rows


def _lazy_pass(forward: object, device: str, max_reqs: int, max_len: int,
               sizes: tuple[int, ...]) -> list[dict]:
    st = RequestState(max_reqs, max_len, BLOCK, device)
    policy = startup_policy(max_reqs, max_len)
    runner = GraphRunner(forward, st, RunnerConfig(policy=policy, lazy_capture=True))
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        slots = np.array([runner.add_request(f"r{n}.{i}",
                                             rng.integers(0, runner.vocab_size, 16))
                          for i in range(n)])
        _timed(runner, SchedulerOutput(slots, np.full(n, 16)), force_eager=True)
        decode = SchedulerOutput(slots, np.ones(n, dtype=np.int32))
        captured, before = len(runner.lazy_report.keys), runner.lazy_report.seconds
        first = _timed(runner, decode)
        key = runner.lazy_report.keys[captured]
        capture_s = runner.lazy_report.seconds - before  # the whole capture call
        replay, eager = _timed(runner, decode), _timed(runner, decode, force_eager=True)
        rows.append({"key": str(key), "first_step_s": first, "eager_step_s": eager,
                     "capture_s": capture_s, "replay_step_s": replay,
                     "first_over_eager_plus_capture": first / (eager + capture_s)})
        for i in range(n):
            st.remove_request(f"r{n}.{i}")
    return rows


def _lazy_main(args: argparse.Namespace, dtype: torch.dtype) -> list[dict]:
    results = []
    sizes = tuple(n for n in (1, 8, 32, 64, 128, 256) if n <= args.max_reqs)
    for name in args.models.split(","):
        forward, kind = build(name, args.device, dtype)
        forward.allocate_caches(args.max_reqs * -(-args.max_len // BLOCK), BLOCK)
        for r in measure_lazy(forward, args.device, args.max_reqs, args.max_len, sizes):
            results.append({"model": name, "forward": kind, **r})
            print(f"{name:6s} lazy {r['key']}: first step {r['first_step_s'] * 1e3:.1f} ms = "
                  f"{r['first_over_eager_plus_capture']:.2f}x (eager step "
                  f"{r['eager_step_s'] * 1e3:.1f} ms + capture {r['capture_s'] * 1e3:.1f} "
                  f"ms); replayed {r['replay_step_s'] * 1e3:.2f} ms")
        del forward
    return results


def _capture_main(args: argparse.Namespace, dtype: torch.dtype) -> list[dict]:
    results = []
    mixed = tuple(int(t) for t in args.mixed.split(","))
    for name in args.models.split(","):
        forward, kind = build(name, args.device, dtype)
        for logits in ("used", "all"):
            forward.allocate_caches(args.max_reqs * -(-args.max_len // BLOCK), BLOCK)
            r = measure(forward, args.device, args.max_reqs, args.max_len, mixed, logits)
            results.append({"model": name, "forward": kind, "max_reqs": args.max_reqs, **r})
            print(f"{name:6s} {logits:4s} rows: {r['keys']} keys in {r['capture_s']:.2f} s, "
                  f"pool {r['pool_mib']:.0f} MiB (estimated {r['estimate_mib']:.0f}); eager "
                  f"first step {r['eager_first_step_s']:.3f} s")
            forward.caches = []
            if args.device == "cuda":
                torch.cuda.empty_cache()
        del forward
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", "--model", default="tiny,1b,hf-1b",
                    help="comma-separated: tiny, 1b, hf-1b")
    ap.add_argument("--max-reqs", type=int, default=64, help="the state's max_num_reqs")
    ap.add_argument("--max-len", type=int, default=2048, help="the state's max_model_len")
    ap.add_argument("--mixed", default="512,2048", help="comma-separated mixed key sizes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device")
    ap.add_argument("--out", default=None, help="folder for startup.json")
    ap.add_argument("--lazy", action="store_true",
                    help="first steps of new keys with lazy capture (startup_lazy.json)")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    results = (_lazy_main if args.lazy else _capture_main)(args, dtype)
    if args.out:
        meta = result_meta("bench.startup", args)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / ("startup_lazy.json" if args.lazy else "startup.json")).write_text(
            json.dumps({**meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
