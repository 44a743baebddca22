"""Shared prefixes: N requests after one system prompt of P tokens, each with its own suffix,
served with prefix caching off (every prompt prefilled whole), on (`BlockManager`: a hit
shares the cached blocks and prefills only its suffix), and on with shared-prefix attention
(`BucketPolicy.shared_prefix_sizes`: decode steps read the shared blocks once per KV head
for the whole group, `graphattn.cascade`).

The first request runs alone until its first token (a miss either way); the other N - 1
then arrive together. Each row: time to first token of the first request and of the others
(host clock, admission to the token on the host), prompt tokens prefilled, tokens/s over
the whole run, decode µs per step (all N rows, replayed graphs), the decode keys' shared
prefix, and whether the tokens equal the off row's (greedy). `--compile`: the forward
compiled by inductor in each graph; `--profile`: each row also profiles 20 more replayed
decode steps and prints its kernels grouped by name (`bench.kernel_profile.kernels`; CUDA).

    python -m bench.prefix_cache [--model tiny] [--prefix 1024] [--requests 16] [--out DIR]
        [--compile] [--profile]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.setup import MODELS, result_meta
from graphattn import BucketPolicy, GraphRunner, RequestState, RunnerConfig, SchedulerOutput
from graphattn.blocks import BlockManager
from graphattn.models.tiny import TinyDecoder

BLOCK = 16
PROFILE_STEPS = 32


def _runner(model: TinyDecoder, device: str, max_reqs: int, max_len: int,
            prefix: int, compile: bool = False) -> GraphRunner:
    """A runner for `max_reqs` requests; `prefix` > 0: shared-prefix keys of that length;
    `compile`: inductor inside the graphs."""
    st = RequestState(max_reqs, max_len, BLOCK, device)
    model.allocate_caches(st.num_kv_blocks, BLOCK)
    bounds = tuple(b for b in (512, 2048, 8192) if b < max_len) + (max_len,)
    # decode steps run all N rows (the prompts are prefilled by mixed keys): one decode size
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(
        capture_sizes=(max_reqs,), length_boundaries=bounds, mixed_token_sizes=(256, 512),
        shared_prefix_sizes=(prefix // BLOCK * BLOCK,) if prefix else ()), compile=compile))
    runner.capture(progress=False)
    return runner


def _until_first_tokens(runner: GraphRunner, rids: list[str], budget: int = 512) -> None:
    """Prefill `rids` in chunks under a token budget until each has its first token."""
    st = runner.state
    slots = st.slots_of(rids)
    while (left := st.num_prompt_tokens_np[slots] - st.num_computed_tokens_np[slots]).any():
        take = np.minimum(left, np.maximum(budget - (np.cumsum(left) - left), 0))
        out = runner.step(SchedulerOutput(slots[take > 0], take[take > 0]))
    out.sampled_host.wait()


def serve(runner: GraphRunner, prompts: list[np.ndarray], new: int, cache: bool,
          profile: bool = False) -> dict:
    """Serve every prompt to `new` tokens; TTFTs, prefill tokens, tokens/s and the tokens;
    `profile`: then the kernels of `PROFILE_STEPS` more decode steps (``kernels``)."""
    st, manager = runner.state, BlockManager(runner.state.num_kv_blocks, BLOCK)
    ttft, prefilled = [], 0
    t0 = time.perf_counter()
    for group in ([0], list(range(1, len(prompts)))):
        t = time.perf_counter()
        for i in group:
            blocks, done = manager.allocate(f"r{i}", prompts[i], len(prompts[i]) + new + 1
                                            + (PROFILE_STEPS if profile else 0))
            runner.add_request(f"r{i}", prompts[i], blocks, done if cache else 0)
            prefilled += len(prompts[i]) - (done if cache else 0)
        _until_first_tokens(runner, [f"r{i}" for i in group])
        ttft.append(time.perf_counter() - t)
        if cache:
            manager.cache("r0", prompts[0])
    slots = st.slots_of([f"r{i}" for i in range(len(prompts))])
    t_dec = time.perf_counter()
    for _ in range(new - 1):
        out = runner.step(SchedulerOutput(slots, np.ones(slots.size, np.int32)))
    out.sampled_host.wait()
    wall = time.perf_counter() - t0
    decode_us = 1e6 * (time.perf_counter() - t_dec) / max(new - 1, 1)
    ends = st.num_computed_tokens_np[slots] + 1
    tokens = [runner.token_ids[s, len(p):e].tolist() for s, p, e in zip(slots, prompts, ends,
                                                                         strict=True)]
    shared = out.key.shared_prefix if out.key else 0
    table = _profile(runner, slots, f"caching {cache}, shared prefix {shared}") if profile \
        else None
    for i in range(len(prompts)):
        st.remove_request(f"r{i}")
    return {"prefix_caching": cache, "ttft_first_s": ttft[0], "ttft_hits_s": ttft[1],
            "prefill_tokens": prefilled, "tokens_per_s": len(prompts) * new / wall,
            "decode_us_per_step": decode_us, "shared_prefix": shared, "replayed": out.replayed,
            "tokens": tokens,
            **({"kernels": table} if table else {})}


def _profile(runner: GraphRunner, slots: np.ndarray, label: str) -> dict:
    """The GPU time (CUDA events) and kernels of replayed decode steps of `slots` (at most
    `PROFILE_STEPS` in all), printed and returned: {"step_us": median µs, "step_kernel_us":
    summed kernel µs per step, "kernels": {name: [launches, µs] per step}}."""
    from bench.graph_replay import event_times
    from bench.kernel_profile import STEPS, kernels

    assert STEPS + 3 + 6 <= PROFILE_STEPS
    sched = SchedulerOutput(slots, np.ones(slots.size, np.int32))
    step_us = float(np.median(event_times(lambda: runner.step(sched), 5, warmup=1)))
    table, total, _ = kernels(lambda: runner.step(sched))
    print(f"## {label}: step {step_us:.1f} µs (CUDA events), kernels {total:.1f} µs per step")
    for name, (count, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"{us:8.1f} µs {count:5.1f}x  {name}")
    return {"step_us": step_us, "step_kernel_us": total,
            "kernels": {k: list(v) for k, v in table.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--models", default="tiny", choices=sorted(MODELS),
                    help="model shape (random weights)")
    ap.add_argument("--prefix", type=int, default=1024, help="system prompt tokens")
    ap.add_argument("--requests", type=int, default=16, help="requests sharing it")
    ap.add_argument("--new", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device")
    ap.add_argument("--out", default=None,
                    help="folder for prefix_cache_MODEL_PREFIX[_compiled].json")
    ap.add_argument("--compile", action="store_true", help="inductor inside the graphs")
    ap.add_argument("--profile", action="store_true",
                    help="print each row's decode kernels (CUDA; torch.profiler)")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = TinyDecoder(MODELS[args.model]).to(dtype)
    rng = np.random.default_rng(0)
    vocab = MODELS[args.model].vocab_size
    system = rng.integers(0, vocab, args.prefix)
    prompts = [np.concatenate([system, rng.integers(0, vocab, int(rng.integers(64, 513)))])
               for _ in range(args.requests)]
    max_len = -(-(args.prefix + 512 + args.new + 1) // 512) * 512
    max_len += PROFILE_STEPS if args.profile else 0  # room for the profiled steps
    runner = _runner(model, args.device, args.requests, max_len, 0, args.compile)
    rows = [serve(runner, prompts, args.new, cache, args.profile) for cache in (False, True)]
    del runner
    cascade = _runner(model, args.device, args.requests, max_len, args.prefix, args.compile)
    rows.append(serve(cascade, prompts, args.new, True, args.profile))
    rows[-1]["shared_prefix_attention"] = True
    off = rows[0]["tokens"]
    for r in rows:
        r["same_tokens_as_off"] = r.pop("tokens") == off
    print(json.dumps(rows, indent=1))
    if args.out:
        meta = result_meta("bench.prefix_cache", args)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = f"prefix_cache_{args.model}_{args.prefix}{'_compiled' if args.compile else ''}"
        (Path(args.out) / f"{name}.json").write_text(
            json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
