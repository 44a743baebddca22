"""torch.compile(mode="reduce-overhead") baseline for uniform decode, in its own process.

The model forward is compiled with inductor's CUDA graphs and run by a GraphRunner that
captured nothing: each step is planned for its key (padded sizes, bucketed length, so
shapes repeat and nothing recompiles per length) and runs prepare, build and the
write-back eagerly around the compiled forward. An untimed pass over the same steps first
compiles every key the timed pass meets, so no compile lands in the timing.

By default each length starts from a fresh compile (``torch._dynamo.reset()``);
``--no-reset`` compiles once for every length: the attention op reads its length bucket
from a CPU tensor (``kv_bounds``), one per bucket and marked as a static input, so
inductor's CUDA-graph trees record a graph per bucket rather than replaying one bucket's
launch for another (before that marking, recording failed: a CPU input staged into the
graph pool). ``--static-caches`` marks the KV caches static, as transformers' StaticCache
does. One step per shape also runs the eager forward on the same inputs and records the
logits' relative error and argmax agreement. Run by bench.graph_replay as a subprocess;
prints one JSON row per (length, batch).

    python -m bench.compile_baseline --model tiny --sizes 1,8,32,128 --lengths 512,2048 \
        --no-reset --static-caches
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import time

import numpy as np
import torch
import torch._inductor.config

from bench.graph_replay import (
    WARMUP,
    _error,
    _summary,
    event_times,
    hbm_bandwidth,
    kv_bytes,
    replay_policy,
    weight_bytes,
)
from bench.setup import MODELS, add_shape_options, fill_requests, make_setup, set_lengths
from graphattn import GraphRunner, RunnerConfig
from graphattn.state import SchedulerOutput


class _Checked:
    """The compiled forward; while `errors` is a list, the eager forward on the same inputs
    too (its KV write repeats the compiled one's: the same values to the same slots), each
    call's logits compared: (max |compiled - eager| / max |eager|, argmax agreement)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.compiled = torch.compile(model, mode="reduce-overhead")
        self.errors: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __call__(self, inputs: dict[str, torch.Tensor], meta) -> torch.Tensor:
        out = self.compiled(inputs, meta)
        if self.errors is not None:
            ref = self.model(inputs, meta).float()
            got = out.float()
            self.errors.append(((got - ref).abs().max() / ref.abs().max(),
                                (got.argmax(-1) == ref.argmax(-1)).float().mean()))
        return out


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", "--models", default="tiny",
                    help="bench model: tiny or 1b (a Llama-3.2-1B shape)")
    add_shape_options(ap)
    ap.add_argument("--static-caches", action="store_true",
                    help="mark the KV caches and rotary frequencies as static addresses "
                         "(torch._dynamo.mark_static_address), as transformers' StaticCache "
                         "does for reduce-overhead")
    ap.add_argument("--no-reset", action="store_true",
                    help="one compile for every length (see the module docstring)")
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="set an inductor config entry (dotted key, Python literal value)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    return args


def _set_inductor(items: list[str]) -> None:
    """Each KEY=VALUE of --inductor into ``torch._inductor.config``."""
    for item in items:
        key, value = item.split("=", 1)
        *path, name = key.split(".")
        setattr(functools.reduce(getattr, path, torch._inductor.config), name,
                ast.literal_eval(value))


def _measure(row: dict, runner: GraphRunner, compiled: _Checked, setup, sched: SchedulerOutput,
             lens: np.ndarray, steps: int, floor: float) -> None:
    """Compile pass, timed pass and one checked step of `sched` into `row`."""
    from torch._dynamo.utils import counters

    graphs0 = counters["stats"].get("unique_graphs", 0)
    set_lengths(setup.state, lens)
    t0 = time.perf_counter()
    for _ in range(WARMUP + steps):  # compiles and records every key it meets
        runner.step(sched)
    torch.cuda.synchronize()
    row["compile_s"] = time.perf_counter() - t0
    graphs1 = counters["stats"].get("unique_graphs", 0)
    set_lengths(setup.state, lens)
    row.update(_summary(event_times(lambda s=sched, r=runner: r.step(s), steps)))
    row["floor_us"] = floor
    row["x_floor"] = row["us_step"] / floor
    row["dynamo_graphs"] = graphs1 - graphs0
    row["timed_recompiles"] = counters["stats"].get("unique_graphs", 0) - graphs1
    compiled.errors = []
    runner.step(sched)
    err, agree = compiled.errors[0]
    row["max_rel_err_vs_eager"] = float(err)
    row["argmax_agreement_vs_eager"] = float(agree)


def main() -> None:
    args = _args()
    _set_inductor(args.inductor)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    lengths = tuple(int(s) for s in args.lengths.split(","))
    cfg = MODELS[args.model]
    bw = hbm_bandwidth()
    policy, max_len = replay_policy(sizes, lengths, args.steps)
    setup = make_setup("cuda", max(sizes), max_len, policy, cfg)
    fill_requests(setup, max(sizes), np.full(max(sizes), 16, np.int32),
                  np.random.default_rng(0))
    if args.static_caches:
        for t in (setup.model.inv_freq, *(c for pair in setup.model.caches for c in pair)):
            torch._dynamo.mark_static_address(t)
    wbytes = weight_bytes(setup.model)
    rng = np.random.default_rng(1)
    for length in lengths:
        if not args.no_reset or length == lengths[0]:
            torch._dynamo.reset()
            compiled = _Checked(setup.model)
            runner = GraphRunner(compiled, setup.state, RunnerConfig(policy=policy))
        for n in sizes:
            lens = rng.integers(length - 16, length + 16, max(sizes)).astype(np.int32)
            sched = SchedulerOutput(np.arange(n, dtype=np.int32), np.ones(n, np.int32))
            row = {"model": args.model, "mode": "torch_compile_reduce_overhead", "batch": n,
                   "length": length, "static_caches": args.static_caches,
                   "inductor": args.inductor, "reset_per_length": not args.no_reset}
            live = float(lens[:n].sum() + n * (WARMUP + args.steps / 2))
            try:
                _measure(row, runner, compiled, setup, sched, lens, args.steps,
                         1e6 * (wbytes + kv_bytes(cfg, live)) / bw)
            except Exception as e:  # noqa: BLE001 - recorded in the table, not hidden
                row.update(_error(row["mode"], e))
            compiled.errors = None
            print("ROW " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
