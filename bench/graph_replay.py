"""Uniform decode, every mode side by side on the same weights (seeded: each mode group runs
in its own process, so one group's failure, such as the 1b eager-SDPA peer's invalidated
capture, cannot take the other rows, and no compile state leaks between groups).

    python -m bench.graph_replay [--models tiny,1b] [--sizes 1,8,32,128] [--lengths 512,2048]
                                 [--steps 100] [--out bench/results]

Modes: `graphattn_graphs` (Triton kernels, eager model, our graphs),
`graphattn_compiled_graphs` (inductor-compiled forward inside our graphs),
`graphattn_compiled_pdl` (the same with `CompileConfig(pdl=True)`: inductor's kernels with
programmatic dependent launch),
`graphattn_compiled_dynamic` (`graphattn_compiled_pdl` with `CompileConfig(dynamic=True)`:
the batch shapes share one compile),
`graphattn_compiled_blocks` (`graphattn_compiled_dynamic` with `CompileConfig(regions=
"blocks")`: the layers share one compile, the rest of the step runs uncompiled in the graph),
`graphattn_gemv` (`graphattn_compiled_pdl` with the projections of up to 16 rows through
the Triton GEMV, `graphattn.backends.linear.swap_linears`),
`graphattn_fp8kv` (the same over a float8_e4m3fn KV cache; its floor counts 1-byte KV),
`graphattn_small_m` (`graphattn_compiled_pdl` with `TinyDecoder.small_m`: batches of up
to 16 tokens run each projection as the Triton GEMV with the residual add and norm before
it, and the gated activation after the up projection, in the same launch),
`hf_graphs` / `hf_compiled_pdl` (a transformers `LlamaForCausalLM` of the same shape, tied
embeddings, through `HFCausalLM`: its own forward in our graphs, eager or compiled with
programmatic dependent launch; the same weight bytes in the floor), `hf_fused_pdl`
(`hf_compiled_pdl` after `graphattn.fuse_projections`: q / k / v and gate / up one matmul
each), `hf_gemv` (`hf_fused_pdl` with its projections of up to 16 rows through the Triton
GEMV, `swap_linears`),
`torch_compile_reduce_overhead` (bench.compile_baseline, its own process),
`handwritten_sdpa_graph` / `handwritten_compiled_graph` (bench.handwritten), and
`replay_floor` / `replay_floor_compiled` (the graphs of `graphattn_graphs` /
`graphattn_compiled_graphs` replayed back to back with no host work: the GPU time alone).

Each row: `us_step` (median of CUDA-event step times, with p25/p75), `floor_us` ((weight
bytes + live KV bytes) / the HBM bandwidth of a device copy measured in the same run),
`x_floor`, `host_us` (median host time of a step call; the loop reads each step's tokens one
step late, as a serving loop does, so no call waits on the token ring), `host_stage_us` (median
host µs of each stage of a step, from a second run with the stage timer on), `kernels` (nodes of
the step's CUDA graph), `capture_s`, `pool_mb`. An `attention` row per model times the
attention op alone on the batch-128 / longest-length shape (`kv_tbps`: KV bytes over its
time); `attention_b1_*` rows time each layer's batch-1 decode attention chained in one graph,
its splits merged inside the launch or by the merge kernel.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.setup import (
    MODELS,
    add_shape_options,
    fill_requests,
    hf_llama,
    make_setup,
    result_meta,
    set_lengths,
)
from bench.timing import capture_warm
from graphattn import CompileConfig, GraphRunner, RunnerConfig
from graphattn.backends.linear import swap_linears
from graphattn.buckets import BucketPolicy
from graphattn.capture.profiling import StageProfiler
from graphattn.models.projections import fuse_projections
from graphattn.state import SchedulerOutput

WARMUP = 5
RUNNER_MODES = ("graphattn_graphs", "graphattn_compiled_graphs", "graphattn_compiled_pdl",
                "graphattn_compiled_dynamic", "graphattn_compiled_blocks", "graphattn_gemv",
                "graphattn_fp8kv", "graphattn_small_m", "hf_graphs", "hf_compiled_pdl",
                "hf_fused_pdl", "hf_gemv")
HANDWRITTEN = {"handwritten_sdpa_graph": None, "handwritten_compiled_graph": "default"}
FLOORS = {"graphattn_graphs": "replay_floor", "graphattn_compiled_graphs": "replay_floor_compiled"}
MODES = (*RUNNER_MODES, "torch_compile_reduce_overhead", *HANDWRITTEN, *FLOORS.values(),
         "attention")


def hbm_bandwidth(gib: float = 2.0, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy (bytes read + written), median of `reps`."""
    src = torch.randint(0, 255, (int(gib * 2**30),), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    return 2 * gib * 2**30 / (np.median(event_times(copy, reps, warmup=2)) * 1e-6)


def event_times(fn, steps: int, warmup: int = WARMUP) -> np.ndarray:
    """µs between CUDA events recorded around each call (the GPU time the step took,
    idle gaps while the host lags included)."""
    for _ in range(warmup):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(steps)]
    torch.cuda.synchronize()
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return 1e3 * np.array([a.elapsed_time(b) for a, b in ev])


def graph_nodes(graph: torch.cuda.CUDAGraph | None) -> int | None:
    """Kernel (and memcpy/memset) nodes of a captured graph, when torch and cuda-python expose
    them."""
    if graph is None or not hasattr(graph, "raw_cuda_graph"):
        return None
    try:
        from cuda.bindings import runtime

        raw = graph.raw_cuda_graph()
        for handle in (raw, runtime.cudaGraph_t(init_value=raw)):
            try:
                err, _, count = runtime.cudaGraphGetNodes(handle, 0)
                if int(err) == 0:
                    return int(count)
            except TypeError:
                continue
    except Exception:  # noqa: BLE001 - an optional column
        return None
    return None


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights (the embedding table: only its rows)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if not n.startswith("embed"))


def kv_bytes(cfg, total_len: float, elem: int = 2) -> float:
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem * total_len


def _summary(times: np.ndarray) -> dict:
    return {"us_step": float(np.median(times)), "us_p25": float(np.percentile(times, 25)),
            "us_p75": float(np.percentile(times, 75))}


def stage_times(runner: GraphRunner, step, steps: int) -> dict[str, float]:
    """Median host µs per stage over `steps` more calls of `step`, the stage timer on."""
    saved = runner.profiler
    runner.profiler = StageProfiler(nvtx_ranges=False, torch_labels=False, record_times=True)
    try:
        for _ in range(steps):
            step()
        return {k: 1e6 * float(np.median(v)) for k, v in runner.profiler.times.items()}
    finally:
        runner.profiler = saved


def runner_rows(mode: str, setup, runner: GraphRunner, report, cfg, sizes, lengths, steps,
                bw, wbytes, rng, modes: tuple[str, ...], kv_elem: int = 2) -> list[dict]:
    rows = []
    st = setup.state
    for length in lengths:
        for n in sizes:
            lens = rng.integers(length - 16, length + 16, max(sizes)).astype(np.int32)
            sched = SchedulerOutput(np.arange(n, dtype=np.int32), np.ones(n, np.int32))
            keys: list = []
            host: list[float] = []
            late: list = []

            def step(sched=sched, keys=keys, host=host, late=late):
                out = runner.step(sched)
                keys.append(out.key if out.replayed else None)
                host.append(out.host_seconds)
                if late:  # tokens read one step late, as a serving loop does
                    late.pop().wait()
                late.append(out.sampled_host)

            set_lengths(st, lens)
            times = event_times(step, steps)
            if None in keys:
                raise RuntimeError(f"{mode} batch {n}: a step ran without a graph")
            live = float(lens[:n].sum() + n * (WARMUP + steps / 2))
            floor = 1e6 * (wbytes + kv_bytes(cfg, live, kv_elem)) / bw
            key = keys[-1]
            row = {"mode": mode, "batch": n, "length": length, **_summary(times),
                   "floor_us": floor, "host_us": 1e6 * float(np.median(host)),
                   "kernels": graph_nodes(runner.graphs._captured[key].graph),
                   "capture_s": report.seconds, "pool_mb": report.pool_bytes / 2**20,
                   "keys": sorted({str(k) for k in keys})}
            row["host_stage_us"] = stage_times(runner, step, steps)
            rows.append(row)
            if FLOORS.get(mode) in modes:  # the same keys back to back, no host work
                seq = iter(keys[:WARMUP + steps])
                set_lengths(st, lens)
                ft = event_times(lambda seq=seq: runner.graphs.replay_only(next(seq)), steps)
                rows.append({"mode": FLOORS[mode], "batch": n, "length": length,
                             **_summary(ft), "floor_us": floor, "kernels": row["kernels"]})
    return rows


def handwritten_rows(model, cfg, sizes, lengths, steps, bw, wbytes, rng,
                     modes: tuple[str, ...]) -> list[dict]:
    from bench.handwritten import HandwrittenDecode

    rows = []
    for mode, compile_mode in HANDWRITTEN.items():
        if mode not in modes:
            continue
        for length in lengths:
            max_len = -(-(length + 16 + 2 * (WARMUP + steps)) // 128) * 128
            for n in sizes:
                lens = torch.from_numpy(rng.integers(length - 16, length + 16, n)).to("cuda")
                t0 = time.perf_counter()
                hw = HandwrittenDecode(model, n, max_len, compile_mode)
                try:
                    hw.capture(lens)
                except Exception as e:  # noqa: BLE001 - one shape's failure, in the table
                    rows.append({**_error(mode, e), "batch": n, "length": length})
                    del hw
                    torch.cuda.empty_cache()
                    continue
                capture_s = time.perf_counter() - t0
                times = event_times(hw.replay, steps)
                live = float(lens.sum().item() + n * (WARMUP + steps / 2))
                rows.append({"mode": mode, "batch": n, "length": length, **_summary(times),
                             "floor_us": 1e6 * (wbytes + kv_bytes(cfg, live)) / bw,
                             "kernels": graph_nodes(hw.graph), "capture_s": capture_s,
                             "static_len": max_len})
                del hw
                torch.cuda.empty_cache()
    return rows


def attention_rows(cfg, batch: int, length: int, bw: float) -> list[dict]:
    """The attention op alone on one layer's shape, replayed in a CUDA graph."""
    from graphattn.backends.launch_config import has_varlen_paged
    from graphattn.backends.ops import kv_bounds

    bs = 16 if not has_varlen_paged() else 256
    rng = np.random.default_rng(5)
    nblk = -(-(length + 16) // bs)
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kc, vc = (torch.randn(batch * nblk + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
              for _ in range(2))
    bt = torch.from_numpy(rng.permutation(batch * nblk).astype(np.int32).reshape(batch, nblk))
    bt = bt.cuda()
    lens = torch.from_numpy(rng.integers(length - 16, length + 16, batch).astype(np.int32))
    seq = lens.cuda()
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, h, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.zeros(batch, dtype=torch.int64, device="cuda")
    caches = {"triton": (kc, vc), "varlen": (kc, vc),  # fp8: the same values, 1 byte each
              "triton_fp8": tuple(c.to(torch.float8_e4m3fn) for c in (kc, vc))}
    rows = []
    for name, (k_cache, v_cache) in caches.items():
        kernel = name.removesuffix("_fp8")
        total = float(lens.sum()) * hkv * d * 2 * k_cache.element_size()
        if kernel == "varlen" and not has_varlen_paged():
            rows.append({"mode": "attention_varlen", "batch": batch, "length": length,
                         "error": f"torch {torch.__version__} has no varlen_attn block_table"})
            continue

        def call(kernel=kernel, k_cache=k_cache, v_cache=v_cache):
            return torch.ops.graphattn.paged_attention(
                q, k_cache, v_cache, qsl, seq, bt, slots, d ** -0.5, batch, 1,
                kv_bounds(nblk, nblk * bs), 0, 0.0, None, kernel)

        try:
            call()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call()
            times = event_times(g.replay, 50)
            us = float(np.median(times))
            rows.append({"mode": f"attention_{name}", "batch": batch, "length": length,
                         "us_step": us, "floor_us": 1e6 * total / bw, "x_floor": us / (1e6 *
                         total / bw), "kv_tbps": total / (us * 1e-6) / 1e12})
        except Exception as e:  # noqa: BLE001 - recorded in the table, not hidden
            rows.append({"mode": f"attention_{name}", "batch": batch, "length": length,
                         "error": f"{type(e).__name__}: {e}"[:300]})
    return rows


def split_merge_rows(cfg, lengths: tuple[int, ...], layers: int) -> list[dict]:
    """Batch-1 decode attention of `layers` layers chained in one CUDA graph (each layer's
    output the next one's query, each its own cache), split as `decode_config` splits it:
    the splits merged inside the launch (`TritonConfig.merge`) against the merge kernel."""
    from dataclasses import replace

    from graphattn.backends.launch_config import decode_config, device_index, has_pdl

    h, hkv, d, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    rows = []
    for length in lengths:
        nblk = -(-(length + 16) // bs)
        caches = [tuple(torch.randn(nblk, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2)) for _ in range(layers)]
        lens = (torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                torch.tensor([length], dtype=torch.int32, device="cuda"),
                torch.arange(nblk, dtype=torch.int32, device="cuda").view(1, nblk))
        q = torch.randn(1, h, d, device="cuda", dtype=torch.bfloat16)
        base = decode_config(hkv, has_pdl(device_index(q.device)))
        for merge in (True, False):
            g = _chained_attention_graph(q, caches, lens, replace(base, merge=merge))
            us = float(np.median(event_times(g.replay, 200)))
            rows.append({"mode": "attention_b1_" + ("merged_in_launch" if merge else
                                                    "merge_kernel"),
                         "batch": 1, "length": length, "layers": layers, "us_step": us,
                         "us_layer": us / layers, "kernels": graph_nodes(g)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _chained_attention_graph(q: torch.Tensor, caches: list, lens: tuple,
                             config) -> torch.cuda.CUDAGraph:
    """A graph of one `triton_attention` launch per cache, each output the next query;
    `lens`: (query_start_loc, seq_lens, block_table)."""
    from graphattn.backends.triton_launch import triton_attention

    qsl, seq, bt = lens
    max_len = bt.shape[1] * caches[0][0].shape[1]

    def chain() -> torch.Tensor:
        a = q
        for kc, vc in caches:
            a = triton_attention(a, kc, vc, qsl, seq, bt, q.shape[-1] ** -0.5, 1, max_len, 0,
                                 0.0, None, config=config)
        return a

    return capture_warm(chain)


GROUPS = (("graphattn_graphs", "replay_floor"),
          ("graphattn_compiled_graphs", "replay_floor_compiled"), ("graphattn_compiled_pdl",),
          ("graphattn_compiled_dynamic",), ("graphattn_compiled_blocks",), ("graphattn_gemv",),
          ("graphattn_fp8kv",), ("graphattn_small_m",), ("hf_graphs",), ("hf_compiled_pdl",),
          ("hf_fused_pdl",), ("hf_gemv",),
          ("handwritten_sdpa_graph",), ("handwritten_compiled_graph",), ("attention",))


def _error(mode: str, e: BaseException) -> dict:
    import traceback

    return {"mode": mode, "error": f"{type(e).__name__}: {e}"[:300],
            "traceback": traceback.format_exc()[-1200:]}


def replay_policy(sizes: tuple[int, ...], lengths: tuple[int, ...],
                  steps: int) -> tuple[BucketPolicy, int]:
    """The bucket policy and the state's max length of a run: every size captured, one length
    bucket (a power of two) above each length after `steps` + warm-up steps."""
    max_len = max(lengths) + 16 + 2 * (WARMUP + steps) + 64
    bounds = tuple(sorted({1 << (x + 16 + 2 * (WARMUP + steps)).bit_length() for x in lengths}))
    return BucketPolicy(capture_sizes=tuple(sorted(sizes)),
                        length_boundaries=tuple(b for b in bounds if b < max_len)), max_len


def mode_runner(mode: str, setup, policy: BucketPolicy) -> GraphRunner:
    """The runner of a runner mode, on the setup's state (each mode group has its own process
    and model)."""
    if mode == "graphattn_graphs":
        return setup.runner
    k0 = setup.model.caches[0][0]
    forward = setup.model
    if mode == "graphattn_fp8kv":  # the compiled mode over an fp8 KV cache
        setup.model.allocate_caches(k0.shape[0] - 1, k0.shape[1], "fp8_e4m3")
    if mode == "graphattn_gemv":
        swap_linears(setup.model)
    setup.model.small_m = mode == "graphattn_small_m"
    if mode.startswith("hf_"):
        forward = hf_llama(k0.device, k0.dtype, setup.model.cfg)
        if mode in ("hf_fused_pdl", "hf_gemv"):
            fuse_projections(forward.model)
        if mode == "hf_gemv":
            swap_linears(forward.model)
        setup.model.caches = []
        forward.allocate_caches(k0.shape[0] - 1, k0.shape[1])
    compile_cfg = CompileConfig(enabled=mode != "hf_graphs", pdl=mode in (
        "graphattn_compiled_pdl", "graphattn_compiled_dynamic", "graphattn_compiled_blocks",
        "graphattn_gemv", "graphattn_small_m", "hf_compiled_pdl", "hf_fused_pdl", "hf_gemv"),
        dynamic=mode in ("graphattn_compiled_dynamic", "graphattn_compiled_blocks"),
        regions="blocks" if mode == "graphattn_compiled_blocks" else "step")
    return GraphRunner(forward, setup.state, RunnerConfig(policy=policy, compile=compile_cfg))


def run_model(name: str, sizes: tuple[int, ...], lengths: tuple[int, ...], steps: int,
              modes: tuple[str, ...], emit) -> None:
    """Rows of `modes` for one model, each passed to `emit` as soon as it exists."""
    cfg = MODELS[name]
    bw = hbm_bandwidth()
    torch.cuda.empty_cache()

    def out(rows: list[dict]) -> None:
        for r in rows:
            r.update(model=name, hbm_tbps=bw / 1e12)
            if "us_step" in r and "floor_us" in r:
                r["x_floor"] = r["us_step"] / r["floor_us"]
            emit(r)

    policy, max_len = replay_policy(sizes, lengths, steps)
    # built outside inference mode: inductor cannot compile over inference-tensor weights
    setup = make_setup("cuda", max(sizes), max_len, policy, cfg)
    fill_requests(setup, max(sizes), np.full(max(sizes), 16, np.int32), np.random.default_rng(0))
    wbytes = weight_bytes(setup.model)
    for mode in RUNNER_MODES:
        if mode not in modes:
            continue
        try:
            runner = mode_runner(mode, setup, policy)
            runner.graphs.keep_graphs = True  # node counts
            report = runner.capture(progress=False)
            out(runner_rows(mode, setup, runner, report, cfg, sizes, lengths, steps, bw,
                            wbytes, np.random.default_rng(1), modes,
                            1 if mode == "graphattn_fp8kv" else 2))
        except Exception as e:  # noqa: BLE001 - recorded in the table, not hidden
            out([_error(mode, e)])
    if set(HANDWRITTEN) & set(modes):
        setup.model.caches = []  # the peers bring their own static caches
        setup.runner = None
        torch.cuda.empty_cache()
        try:
            out(handwritten_rows(setup.model, cfg, sizes, lengths, steps, bw, wbytes,
                                 np.random.default_rng(1), modes))
        except Exception as e:  # noqa: BLE001
            out([_error("handwritten", e)])
    if "attention" in modes:
        out(attention_rows(cfg, max(sizes), max(lengths), bw))
        out(split_merge_rows(cfg, lengths, cfg.num_layers))


def compile_rows(name: str, sizes, lengths, steps) -> list[dict]:
    """torch.compile reduce-overhead, in its own process (see bench.compile_baseline)."""
    cmd = [sys.executable, "-m", "bench.compile_baseline", "--model", name, "--sizes",
           ",".join(map(str, sizes)), "--lengths", ",".join(map(str, lengths)),
           "--steps", str(steps), "--no-reset", "--static-caches"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return [{"model": name, "mode": "torch_compile_reduce_overhead", "error": "timeout"}]
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if not rows:
        rows = [{"model": name, "mode": "torch_compile_reduce_overhead",
                 "error": proc.stderr[-400:]}]
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: one line per (model, length, batch), modes as columns (µs and x floor)."""
    modes = [m for m in MODES if any(r.get("mode") == m for r in rows)]
    head = "| model | length | batch | floor µs | " + " | ".join(modes) + " |"
    lines = [head, "|" + "---|" * (4 + len(modes))]
    cells: dict = {}
    for r in rows:
        if "us_step" in r and r.get("mode") in modes:
            cells[(r["model"], r["length"], r["batch"], r["mode"])] = r
    for m, length, b in sorted({k[:3] for k in cells}, key=lambda k: (k[0] != "tiny", k)):
        floor = next(cells[k]["floor_us"] for k in cells if k[:3] == (m, length, b))
        vals = []
        for mode in modes:
            r = cells.get((m, length, b, mode))
            vals.append("" if r is None else
                        f"{r['us_step']:.0f} ({r['us_step'] / floor:.2f}x)")
        lines.append(f"| {m} | {length} | {b} | {floor:.0f} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,1b",
                    help="comma-separated bench models: tiny, 1b (a Llama-3.2-1B shape)")
    ap.add_argument("--model", help="run one model in this process (used by the parent)")
    add_shape_options(ap)
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated modes to run")
    ap.add_argument("--out", default="bench/results",
                    help="folder for the result files")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (torch.cuda.is_available() is False here)")
    sizes = tuple(int(s) for s in args.sizes.split(","))
    lengths = tuple(int(s) for s in args.lengths.split(","))
    modes = tuple(args.modes.split(","))
    if unknown := set(modes) - set(MODES):
        ap.error(f"--modes: expected some of {', '.join(MODES)}, got {', '.join(sorted(unknown))}")
    if args.model:
        run_model(args.model, sizes, lengths, args.steps, modes,
                  lambda r: print("ROW " + json.dumps(r), flush=True))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = result_meta("bench.graph_replay", args, device="cuda")
    for name in args.models.split(","):
        rows: list[dict] = []
        for group in GROUPS:  # one process per group: no compile or CUDA state leaks across
            want = [m for m in group if m in modes]
            if not want:
                continue
            cmd = [sys.executable, "-m", "bench.graph_replay", "--model", name, "--sizes",
                   args.sizes, "--lengths", args.lengths, "--steps", str(args.steps),
                   "--modes", ",".join(want)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = [json.loads(x[4:]) for x in proc.stdout.splitlines() if x.startswith("ROW ")]
            rows += got
            if proc.returncode:
                rows.append({"model": name, "mode": ",".join(want), "error": proc.stderr[-800:]})
            print(f"{name} {','.join(want)}: {len(got)} rows, rc {proc.returncode}",
                  file=sys.stderr, flush=True)
            save(out, name, rows, meta)
        if "torch_compile_reduce_overhead" in modes:
            rows += compile_rows(name, sizes, lengths, args.steps)
            save(out, name, rows, meta)
    merge(out, args.models.split(","))


def save(out: Path, name: str, rows: list[dict], meta: dict[str, str]) -> None:
    (out / f"graph_replay_{name}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1))


def plot(rows: list[dict], path: Path) -> None:
    """Uniform decode step time over the memory floor, per mode, one panel per model and
    length; the title names the device and torch of the rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("x", "--")]
    decode = [r for r in rows if "us_step" in r and "floor_us" in r and "batch" in r]
    if not decode:
        return
    keys = sorted({(r["model"], r["length"]) for r in decode})
    modes = list(dict.fromkeys(r["mode"] for r in decode))
    style = dict(zip(modes, styles * 3, strict=False))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4.4), squeeze=False)
    for ax, (model, length) in zip(axes[0], keys, strict=True):
        part = [r for r in decode if (r["model"], r["length"]) == (model, length)]
        for mode in modes:
            pts = sorted((r["batch"], r["us_step"] / r["floor_us"]) for r in part
                         if r["mode"] == mode)
            if not pts:
                continue
            marker, ls = style[mode]
            floor = mode.startswith("replay_floor")  # hollow, larger: never hides a line
            ax.plot(*zip(*pts, strict=True), marker=marker, linestyle="none" if floor else ls,
                    markersize=11 if floor else 6, fillstyle="none" if floor else "full",
                    label=mode, color=f"C{modes.index(mode)}")
        ax.set(xlabel="batch", ylabel="step / memory floor", title=f"{model}, length {length}")
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    device = rows[0].get("device", "GPU")
    fig.suptitle(f"uniform decode on {device}, torch {rows[0].get('torch', '?')}: step time / "
                 "memory floor (lower is better)")
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(out: Path, models: list[str]) -> None:
    """graph_replay.json (a list of rows) and graph_replay.md from the files of `models`
    (`graph_replay_<model>.json`; other files in `out`, such as runs on other cards, stay
    out)."""
    rows: list[dict] = []
    for path in (out / f"graph_replay_{name}.json" for name in sorted(models)):
        if not path.exists():
            continue
        got = json.loads(path.read_text())
        rows += [{**r, "date": got["meta"]["date"], "torch": got["meta"]["torch"],
                  "device": got["meta"]["device"], "command": got["meta"]["command"]}
                 for r in got["rows"]]
    (out / "graph_replay.json").write_text(json.dumps(rows, indent=1))
    md = table(rows)
    (out / "graph_replay.md").write_text(f"{md}\n")
    plot(rows, out / "graph_replay.png")
    print(md)
    for r in rows:
        if "error" in r or r.get("mode", "").startswith("attention"):
            print(r)


if __name__ == "__main__":
    main()
