"""End-to-end A/B of the decode attention's launch config in one process (a development aid;
CUDA only): the compiled runner's step and its graph alone for each variant, the
hand-written compiled peer timed before and after them (drift shows as their difference).

    python scripts/config_ab.py [--model 1b] [--batch 32] [--length 512] [--steps 50]
                                [--variants default,fuse,nofuse,stages3,nosplit,nopdl,noattn]
                                [--out DIR]

Variants patch `graphattn.backends.ops` before each runner is captured (the op's Python
implementation runs at capture, so one compiled forward serves them all):

- ``default``: `decode_config` as shipped;
- ``stagesN``, ``wavesN``, ``bnN`` (keys per tile), ``warpsN``: that field replaced;
- ``nosplit``: waves 0 (no split, no merge launch);
- ``nopdl``: without programmatic dependent launch;
- ``noattn``: the attention call replaced by an empty output, to place its in-graph cost
  (the tokens are garbage; only the time means anything);
- ``nofuse`` / ``fuse``: `rope_write_kv` then attention / the fused ``rope_paged_decode``
  (``PagedAttentionImpl.fuse_rope`` False / True; ``default``: as `fuse_rope_decode` picks);
- parts joined by ``+`` combine (``fuse+waves2``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from bench.graph_replay import (
    handwritten_rows,
    hbm_bandwidth,
    replay_policy,
    runner_rows,
    weight_bytes,
)
from bench.setup import MODELS, fill_requests, make_setup
from graphattn.backends import ops
from graphattn.capture.runner import GraphRunner

FIELDS = {"stages": "num_stages", "waves": "waves", "bn": "block_n", "warps": "num_warps"}


@contextlib.contextmanager
def patched(variant: str, impl) -> Iterator[None]:
    """Apply each ``+``-joined part of `variant` (e.g. ``fuse+waves2``)."""
    orig_config, orig_attention = ops.decode_config, ops._triton_attention
    for part in variant.split("+"):
        inner = ops.decode_config
        if part in ("nofuse", "fuse"):
            impl.fuse_rope = part == "fuse"
        elif part == "default":
            pass
        elif part == "nopdl":
            ops.decode_config = lambda programs, pdl=False, f=inner: f(programs, False)
        elif part == "nosplit":
            ops.decode_config = lambda programs, pdl=False, f=inner: dataclasses.replace(
                f(programs, pdl), waves=0)
        elif part == "noattn":
            ops._triton_attention = lambda q, k_cache, v_cache, *a, **k: q.new_empty(
                q.shape[0], q.shape[1], v_cache.shape[-1])
        else:
            name = part.rstrip("0123456789")
            kw = {FIELDS[name]: int(part[len(name):])}
            ops.decode_config = lambda programs, pdl=False, f=inner, kw=kw: dataclasses.replace(
                f(programs, pdl), **kw)
    try:
        yield
    finally:
        ops.decode_config, ops._triton_attention = orig_config, orig_attention
        impl.fuse_rope = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--variants", default="default,fuse,nofuse,stages3,nosplit,nopdl,noattn")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    cfg, sizes, lengths = MODELS[args.model], (args.batch,), (args.length,)
    bw = hbm_bandwidth()
    policy, max_len = replay_policy(sizes, lengths, args.steps)
    setup = make_setup("cuda", args.batch, max_len, policy, cfg)
    fill_requests(setup, args.batch, np.full(args.batch, 16, np.int32),
                  np.random.default_rng(0))
    wbytes = weight_bytes(setup.model)

    def peer(tag: str) -> list[dict]:
        rows = handwritten_rows(setup.model, cfg, sizes, lengths, args.steps, bw, wbytes,
                                np.random.default_rng(1), ("handwritten_compiled_graph",))
        return [dict(r, variant=tag) for r in rows]

    rows = peer("peer_before")
    for variant in args.variants.split(","):
        with patched(variant, setup.model.impl):
            runner = GraphRunner(setup.model, setup.state, policy=policy, compile=True)
            runner.graphs.keep_graphs = True
            report = runner.capture(progress=False)
            rows += [dict(r, variant=variant) for r in runner_rows(
                "graphattn_compiled_graphs", setup, runner, report, cfg, sizes, lengths,
                args.steps, bw, wbytes, np.random.default_rng(1), ("replay_floor_compiled",))]
        del runner
        torch.cuda.empty_cache()
    rows += peer("peer_after")
    for r in rows:
        print(f"{r['variant']:>12} {r['mode']:>28} {r['us_step']:8.1f} µs")
    meta = {"model": args.model, "batch": args.batch, "length": args.length,
            "steps": args.steps, "torch": torch.__version__}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"config_ab_{args.model}_{args.batch}_{args.length}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
