"""The decode projections of a Llama-3.2-1B shape at few rows: cuBLAS (`F.linear`) against
the Triton GEMV (`torch.ops.graphattn.small_m_linear`) and some of its launch configs.

    python -m bench.small_m_linear --out bench/results

Each row replays one CUDA graph of 16 layers' chained projections (qkv -> o -> gate/up ->
down, every layer its own weights, 1.9 GB in bf16: nothing stays in L2) and the LM head,
and reports µs per step and the weight bytes over that time, beside the HBM bandwidth of a
device copy in the same process. Rows with a `shape` time one projection kind alone (its
16 layers' weights, or the LM head), cuBLAS against the default GEMV.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.graph_replay import event_times, hbm_bandwidth
from bench.setup import result_meta
from bench.timing import capture_warm
from graphattn.backends.linear import GemvConfig, gemv_config, launch_small_m_linear

HIDDEN, QKV, INTER, VOCAB, LAYERS = 2048, 3072, 8192, 128256, 16
VARIANTS = {"bn8_bk256": dict(block_n=8, block_k=256), "bn16_bk512": dict(block_n=16, block_k=512),
            "bn32_bk256": dict(block_n=32, block_k=256), "w8_s4": dict(num_warps=8, num_stages=4),
            "pdl": dict(pdl=True)}


def layer_weights(dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: qkv [3072, 2048], o [2048, 2048], gate/up [16384, 2048], down [2048, 8192]."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(dtype)
    return [(w(QKV, HIDDEN), w(HIDDEN, HIDDEN), w(2 * INTER, HIDDEN), w(HIDDEN, INTER))
            for _ in range(LAYERS)]


def step_fn(linear: Callable, weights: list, head: torch.Tensor, x: torch.Tensor) -> Callable:
    def step() -> torch.Tensor:
        h = x
        for wqkv, wo, wgu, wd in weights:
            a = linear(h, wqkv)[:, :HIDDEN]
            h = linear(a, wo)
            gu = linear(h, wgu)
            h = linear(gu[:, :INTER].contiguous(), wd)
        return linear(h, head)
    return step


def graph_time(step: Callable, steps: int) -> float:
    """Median µs of one replay of `step` captured in a CUDA graph."""
    return float(np.median(event_times(capture_warm(step).replay, steps)))


def config_linear(overrides: dict) -> Callable:
    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        base = gemv_config(x.shape[0], w.shape[0], w.shape[1], x.device)
        fields = {f: getattr(base, f) for f in GemvConfig.__slots__}
        return launch_small_m_linear(x, w, GemvConfig(**{**fields, **overrides}))
    return linear


def rows_for(m: int, weights: list, head: torch.Tensor, bw: float, steps: int,
             nbytes: int) -> list[dict]:
    x = torch.randn(m, HIDDEN, device="cuda", dtype=head.dtype)
    ref = step_fn(torch.nn.functional.linear, weights, head, x)()
    modes = {"cublas": torch.nn.functional.linear,
             "gemv": torch.ops.graphattn.small_m_linear,
             **{f"gemv_{k}": config_linear(v) for k, v in VARIANTS.items()}}
    rows = []
    for name, linear in modes.items():
        try:
            step = step_fn(linear, weights, head, x)
            err = float((step().float() - ref.float()).abs().max() / ref.float().abs().max())
            us = graph_time(step, steps)
            rows.append({"mode": name, "rows": m, "us": us, "tb_s": nbytes / us / 1e6,
                         "floor_ratio": us / (nbytes / bw * 1e6), "rel_err": err})
        except Exception as e:  # noqa: BLE001  (a config the device refuses: reported)
            rows.append({"mode": name, "rows": m, "error": f"{type(e).__name__}: {e}"[:200]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def projection_kinds(weights: list, head: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """{kind: its weights}: each projection kind's 16 layers, and the LM head."""
    return {"qkv": [ws[0] for ws in weights], "o": [ws[1] for ws in weights],
            "gate_up": [ws[2] for ws in weights], "down": [ws[3] for ws in weights],
            "lm_head": [head]}


def shape_rows(m: int, weights: list, head: torch.Tensor, bw: float, steps: int) -> list[dict]:
    """Each projection kind alone (its 16 layers' weights, or the LM head), cuBLAS against
    the default GEMV: which shapes, if any, the GEMV should take."""
    rows = []
    for kind, ws in projection_kinds(weights, head).items():
        x = torch.randn(m, ws[0].shape[1], device="cuda", dtype=head.dtype)
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        for name, linear in (("cublas", torch.nn.functional.linear),
                             ("gemv", torch.ops.graphattn.small_m_linear)):
            us = graph_time(lambda f=linear, x=x, ws=ws: [f(x, w) for w in ws], steps)
            rows.append({"mode": name, "rows": m, "shape": kind, "n": ws[0].shape[0],
                         "k": ws[0].shape[1], "us": us, "tb_s": nbytes / us / 1e6,
                         "floor_ratio": us / (nbytes / bw * 1e6)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


SWEEP = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st)
         for bn in (8, 16, 32) for bk in (256, 512, 1024) for w in (4, 8) for st in (1, 3)]


def sweep_rows(m: int, weights: list, head: torch.Tensor, bw: float, steps: int) -> list[dict]:
    """Each projection kind alone under every `SWEEP` config of the GEMV, beside cuBLAS;
    one row per kind: cuBLAS's µs, the best config and its µs."""
    rows = []
    for kind, ws in projection_kinds(weights, head).items():
        x = torch.randn(m, ws[0].shape[1], device="cuda", dtype=head.dtype)
        floor_us = sum(w.numel() * w.element_size() for w in ws) / bw * 1e6
        cublas = graph_time(lambda x=x, ws=ws: [torch.nn.functional.linear(x, w) for w in ws],
                            steps)
        timed = []
        for cfg in SWEEP:
            f = config_linear(cfg)
            try:
                timed.append((graph_time(lambda x=x, ws=ws, f=f: [f(x, w) for w in ws], steps),
                              cfg))
            except Exception:  # noqa: BLE001, S112  (a config the device refuses)
                continue
        best_us, best = min(timed, key=lambda t: t[0])
        rows.append({"mode": "sweep", "rows": m, "shape": kind, "n": ws[0].shape[0],
                     "k": ws[0].shape[1], "cublas_us": cublas, "best_gemv_us": best_us,
                     "best_config": best, "configs": len(timed),
                     "cublas_floor_ratio": cublas / floor_us,
                     "gemv_floor_ratio": best_us / floor_us})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16", help="comma-separated row counts (M)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=None, help="folder for small_m_linear.json")
    ap.add_argument("--sweep", action="store_true",
                    help="only the per-shape sweep of GEMV configs (small_m_linear_sweep.json)")
    args = ap.parse_args()
    dtype = torch.bfloat16
    weights = layer_weights(dtype)
    head = torch.randn(VOCAB, HIDDEN, device="cuda").to(dtype) * HIDDEN ** -0.5
    nbytes = sum(w.numel() * w.element_size() for ws in weights for w in ws) + head.numel() * 2
    bw = hbm_bandwidth()
    print(f"weights {nbytes / 1e9:.2f} GB, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    ms = [int(m) for m in args.rows.split(",")]
    if args.sweep:
        rows = [r for m in ms for r in sweep_rows(m, weights, head, bw, args.steps)]
    else:
        rows = [r for m in ms for r in rows_for(m, weights, head, bw, args.steps, nbytes)]
        rows += [r for m in ms for r in shape_rows(m, weights, head, bw, args.steps)]
    if args.out:
        meta = {**result_meta("bench.small_m_linear", args, device="cuda"),
                "weight_bytes": nbytes, "copy_bandwidth": bw}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "small_m_linear_sweep.json" if args.sweep else "small_m_linear.json"
        (Path(args.out) / name).write_text(
            json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
