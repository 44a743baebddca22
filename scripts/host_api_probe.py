"""Host µs per call of the CUDA API calls a replayed step makes (a development aid: what a
step's host time is made of on this machine).

    python scripts/host_api_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

N = 2000


def per_call(fn, n: int = N) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = 1e6 * (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows: dict[str, float] = {}
    ev = torch.cuda.Event()
    ev.record()
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    rows["current_stream"] = per_call(torch.cuda.current_stream)
    rows["event_record"] = per_call(ev.record)
    rows["event_record_given_stream"] = per_call(lambda: ev.record(stream))
    rows["event_query_done"] = per_call(ev.query)
    rows["event_synchronize_done"] = per_call(ev.synchronize)
    rows["event_new_and_record"] = per_call(lambda: torch.cuda.Event().record())
    host = torch.zeros(300, dtype=torch.int32, pin_memory=True)
    dst = torch.zeros(300, dtype=torch.int32, device=dev)
    rows["h2d_copy_pinned_1kb"] = per_call(lambda: dst.copy_(host, non_blocking=True))
    out_host = torch.zeros(128, dtype=torch.int64, pin_memory=True)
    src = torch.zeros(128, dtype=torch.int64, device=dev)
    rows["d2h_copy_pinned_8_rows"] = per_call(
        lambda: out_host[:8].copy_(src[:8], non_blocking=True))
    rows["slice"] = per_call(lambda: src[:8])
    rows["is_pinned"] = per_call(host.is_pinned)
    try:
        from cuda.bindings import runtime

        kind = runtime.cudaMemcpyKind.cudaMemcpyHostToDevice
        raw = stream.cuda_stream
        dp, hp, nb = dst.data_ptr(), host.data_ptr(), host.numel() * 4
        rows["h2d_cuda_python"] = per_call(
            lambda: runtime.cudaMemcpyAsync(dp, hp, nb, kind, raw))
    except Exception as e:  # noqa: BLE001 - an optional row
        rows["h2d_cuda_python_error"] = f"{type(e).__name__}: {e}"[:200]
    for nodes in (1, 32, 96, 160):
        x = torch.zeros(1, device=dev)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(nodes):
                x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(nodes):
                x.add_(1)
        rows[f"graph_replay_{nodes}_nodes"] = per_call(g.replay, 200)
    print(json.dumps(rows, indent=1))
    if args.out:
        Path(args.out, "host_api_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
