"""Flex attention's two layouts against the paged Triton op, uniform decode, one layer (CUDA).

Each variant runs the metadata build and the attention of one layer's decode shape (one
query per row, lengths length ± 16 in a random block order, bf16) inside one CUDA graph,
replayed 50 times: median µs and the effective bandwidth on the live KV bytes. Variants:
`flex_per_row` (`FlexAttentionBuilder(layout="auto")`: rows on flex's batch axis),
`flex_packed` (`layout="packed"`: every query on one axis over all rows' KV), `paged_triton`
(`PagedAttentionImpl`, the Triton kernel).

    python -m bench.flex_layouts --model tiny --sizes 1,8,32,128 --lengths 512,2048
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench.graph_replay import _error, event_times, hbm_bandwidth
from bench.setup import MODELS, add_shape_options, result_meta
from graphattn.backends.flex import FlexAttentionBuilder, FlexAttentionImpl
from graphattn.backends.paged import PagedAttentionBuilder, PagedAttentionImpl
from graphattn.buckets import LengthBuckets
from graphattn.metadata import CommonAttentionMetadata

BLOCK = 16


def decode_batch(batch: int, length: int, hkv: int, d: int, rng: np.random.Generator
                 ) -> tuple[CommonAttentionMetadata, tuple[torch.Tensor, torch.Tensor], int]:
    """One-token rows at lengths length ± 16 (the new token's slot included), random pages:
    (metadata, bf16 caches [blocks + 1, 16, Hkv, D], the bucket)."""
    bucket = 1 << (length + 16).bit_length()
    nblk = bucket // BLOCK
    lens = rng.integers(length - 16, length + 16, batch).astype(np.int32)
    bt = torch.from_numpy(rng.permutation(batch * nblk).astype(np.int32).reshape(batch, nblk))
    last = lens.astype(np.int64) - 1
    slots = bt.numpy()[np.arange(batch), last // BLOCK].astype(np.int64) * BLOCK + last % BLOCK
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.cuda(), query_start_loc_cpu=qsl, seq_lens=torch.from_numpy(lens).cuda(),
        seq_lens_cpu_upper_bound=torch.from_numpy(lens), num_reqs=batch, num_actual_tokens=batch,
        max_query_len=1, max_seq_len=int(lens.max()), block_table_tensor=bt.cuda(),
        slot_mapping=torch.from_numpy(slots).cuda())
    caches = tuple(torch.randn(batch * nblk + 1, BLOCK, hkv, d, device="cuda",
                               dtype=torch.bfloat16) for _ in range(2))
    return common, caches, bucket


def _timed(step) -> tuple[torch.Tensor, float]:
    """(float32 output of an eager call, median µs of the step captured in a CUDA graph)."""
    first = step().float()  # compiles flex for this shape
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return first, float(np.median(event_times(g.replay, 50)))


def rows_for(model: str, sizes: tuple[int, ...], lengths: tuple[int, ...]) -> list[dict]:
    cfg = MODELS[model]
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bw = hbm_bandwidth()
    rng = np.random.default_rng(0)
    out = []
    for length in lengths:
        for n in sizes:
            common, caches, bucket = decode_batch(n, length, hkv, d, rng)
            q = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            kv_bytes = float(common.seq_lens_cpu_upper_bound.sum()) * hkv * d * 2 * 2
            buckets = LengthBuckets(bucket)
            impls = {"flex_per_row": (FlexAttentionBuilder(BLOCK, buckets),
                                      FlexAttentionImpl(h, d, hkv)),
                     "flex_packed": (FlexAttentionBuilder(BLOCK, buckets, layout="packed"),
                                     FlexAttentionImpl(h, d, hkv)),
                     "paged_triton": (PagedAttentionBuilder(BLOCK), PagedAttentionImpl(h, d, hkv))}
            ref = None
            for variant, (builder, impl) in impls.items():
                row = {"model": model, "mode": variant, "batch": n, "length": length}
                try:
                    first, us = _timed(lambda b=builder, i=impl, a=(q, k, v, caches, common):
                                       i.forward(*a[:4], b.build(a[4])))
                    ref = first if ref is None else ref
                    row.update(max_abs_diff_vs_per_row=float((first - ref).abs().max()),
                               us_step=us, kv_tbps=kv_bytes / (us * 1e-6) / 1e12,
                               floor_us=1e6 * kv_bytes / bw)
                    row["x_floor"] = us / row["floor_us"]
                except Exception as e:  # noqa: BLE001 - recorded in the table, not hidden
                    row.update(_error(variant, e))
                print(json.dumps(row), flush=True)
                out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--models", default="tiny",
                    help="bench model: tiny or 1b (a Llama-3.2-1B shape)")
    add_shape_options(ap, steps=False)
    ap.add_argument("--out", default="bench/results",
                    help="folder for the result files")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    rows = rows_for(args.model, tuple(int(s) for s in args.sizes.split(",")),
                    tuple(int(s) for s in args.lengths.split(",")))
    meta = result_meta("bench.flex_layouts", args, device="cuda")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"flex_layouts_{args.model}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
