"""What a step's host<->device copies cost around a replayed graph, and where they could go
(a development aid for bench/RESULTS.md; CUDA only).

    python scripts/step_copies.py [--kernels 160] [--rows 32] [--out DIR]

One synthetic graph of `--kernels` small GEMMs + ReLUs (about a 1B model's decode step in
launches) reads a packed int32 input and ends in an argmax over `--rows` rows. Variants,
each timed as CUDA events around back-to-back steps (median µs per step):

- ``graph``: the replay alone (the floor);
- ``copies``: the runner's pattern today: H2D of a pinned staging buffer into the static input,
  the replay, D2H of the tokens into a pinned slot, an event; ``event``, ``h2d``, ``d2h``: one
  part of it each;
- ``side_streams``: what the runner does now: `graphattn.transfer.Uploader` (the host read on a
  side stream, a device copy on the compute stream) and the token ring's device copy + host
  copy on a side stream;
- ``in_graph`` (``_h2d``, ``_d2h``): the copies captured as memcpy nodes of the graph (fixed
  pinned buffers);
- ``mapped`` (``_in``, ``_out``): the copies as kernels of the graph that read / write pinned
  host memory through its device address (unified addressing), no memcpy at all.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench.graph_replay import event_times
from graphattn.capture.runner import _OutputRing
from graphattn.transfer import Uploader


class _CudaView:
    """__cuda_array_interface__ of a pinned host tensor (its address is valid on the device)."""

    def __init__(self, t: torch.Tensor) -> None:
        typestr = {torch.int32: "<i4", torch.int64: "<i8"}[t.dtype]
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": typestr,
                                         "data": (t.data_ptr(), False), "version": 3,
                                         "strides": None}


def mapped(t: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(_CudaView(t), device="cuda")


def time_steps(step, reps: int = 200) -> float:
    return float(np.median(event_times(step, reps, warmup=20)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, default=160)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--width", type=int, default=4096, help="int32 words of packed input")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    torch.manual_seed(0)
    n, hid = args.rows, 2048
    ws = [torch.randn(hid, hid, device="cuda", dtype=torch.bfloat16) * hid ** -0.5
          for _ in range(args.kernels // 2)]
    static_in = torch.zeros(args.width, dtype=torch.int32, device="cuda")
    static_out = torch.zeros(n, dtype=torch.int64, device="cuda")
    x0 = torch.randn(n, hid, device="cuda", dtype=torch.bfloat16)

    def body() -> None:
        x = x0 + static_in[:n, None].to(x0.dtype)
        for w in ws:
            x = torch.relu(x @ w)
        static_out.copy_(x.argmax(-1))

    pin_in = [torch.randint(0, 3, (args.width,), dtype=torch.int32).pin_memory()
              for _ in range(8)]
    pin_out = [torch.zeros(n, dtype=torch.int64).pin_memory() for _ in range(8)]
    events = [torch.cuda.Event() for _ in range(8)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(s)

    def capture(fn) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    rows = {}
    g = capture(body)
    rows["graph"] = time_steps(g.replay)
    i = [0]

    def copies() -> None:
        k = i[0] = (i[0] + 1) % 8
        events[k].synchronize()
        static_in.copy_(pin_in[k], non_blocking=True)
        g.replay()
        pin_out[k].copy_(static_out, non_blocking=True)
        events[k].record()

    rows["copies"] = time_steps(copies)
    uploader = Uploader("cuda")
    ring = _OutputRing(n, torch.device("cuda"), stream=torch.cuda.Stream())

    def side_streams() -> None:
        k = i[0] = (i[0] + 1) % 8
        events[k].synchronize()
        uploader.copy_(static_in, pin_in[k])
        g.replay()
        events[k].record()
        ring.push(static_out)

    rows["side_streams"] = time_steps(side_streams)
    rows["event"] = time_steps(lambda: (g.replay(), events[0].record()))
    rows["h2d"] = time_steps(lambda: (static_in.copy_(pin_in[1], non_blocking=True),
                                      g.replay()))
    rows["d2h"] = time_steps(lambda: (g.replay(),
                                      pin_out[1].copy_(static_out, non_blocking=True)))
    fixed_in, fixed_out = pin_in[0], pin_out[0]
    variants = {
        "in_graph": (lambda: static_in.copy_(fixed_in, non_blocking=True),
                     lambda: fixed_out.copy_(static_out, non_blocking=True)),
        "in_graph_h2d": (lambda: static_in.copy_(fixed_in, non_blocking=True), None),
        "in_graph_d2h": (None, lambda: fixed_out.copy_(static_out, non_blocking=True)),
    }
    try:
        m_in, m_out = mapped(fixed_in), mapped(fixed_out)
        m_in.sum().item()  # the device reads host memory through the view
    except Exception as e:  # noqa: BLE001 - reported, the other variants stand
        rows["mapped_error"] = f"{type(e).__name__}: {e}"
    else:
        variants.update({
            "mapped": (lambda: static_in.copy_(m_in), lambda: m_out.copy_(static_out)),
            "mapped_in": (lambda: static_in.copy_(m_in), None),
            "mapped_out": (None, lambda: m_out.copy_(static_out)),
        })
    for name, (pre, post) in variants.items():
        def wrapped(pre=pre, post=post) -> None:
            if pre is not None:
                pre()
            body()
            if post is not None:
                post()

        gv = capture(wrapped)
        rows[name] = time_steps(gv.replay)
        if name == "mapped":
            gv.replay()
            torch.cuda.synchronize()
            rows["mapped_tokens_match"] = bool(torch.equal(fixed_out, static_out.cpu()))
    rows.update(kernels=args.kernels, rows=n, width=args.width, torch=torch.__version__)
    print(json.dumps(rows, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "step_copies.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
