"""DeepSeek-V3.2's decode step: sparse attention (the indexer's top-k, `sparse_indexer`
backend) beside dense latent attention (the same shapes without an indexer, `mla` backend).

A stack of a few layers with DeepSeek-V3.2's attention dimensions (128 heads, latent 512 +
rope 64, q-lora 1,536, indexer 64 heads x 128, top-2,048) and dense MLPs (the routed experts
of the real model would not fit a few-layer stack's point: attention), random bf16 weights,
through `HFCausalLM` + `GraphRunner`: every row is one replayed uniform-decode graph of
`batch` rows at about `length` cached tokens each, timed with CUDA events (the host clock on
CPU). Besides µs per step, each row states the cache bytes a step reads by construction
(dense: every latent; sparse: every index key plus top-k latents) and the host reads of
device state per step (0).

    python -m bench.deepseek_step --sizes 1,32,128 --lengths 2048,16384 --out bench/results
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from bench.graph_replay import replay_policy
from bench.setup import result_meta, set_lengths
from bench.timing import spread, step_times, syncs_per_step
from graphattn import GraphRunner, RequestState, RunnerConfig, SchedulerOutput

# DeepSeek-V3.2's attention dimensions; dense MLPs of its dense layers
V32 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
           moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128,
           q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
           v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048,
           n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
           max_position_embeddings=163840)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=8,
            index_head_dim=16, index_topk=16, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, max_position_embeddings=4096)
SHAPES = {"v32": V32, "tiny": TINY}
PATHS = {"sparse": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
         "dense": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}
BLOCK = 64


def build(path: str, shape: dict, layers: int, device: str) -> torch.nn.Module:
    """A random DeepSeek stack of `layers` dense-MLP layers (V3.2 with its indexer for
    "sparse", V3 without for "dense"), bf16 on CUDA, float32 on CPU."""
    import transformers

    cfg_name, model_name = PATHS[path]
    keys = getattr(transformers, cfg_name).__dataclass_fields__ if hasattr(
        getattr(transformers, cfg_name), "__dataclass_fields__") else None
    params = {k: v for k, v in shape.items() if path == "sparse" or not k.startswith("index_")}
    if keys is not None:
        params = {k: v for k, v in params.items() if k in keys}
    cfg = getattr(transformers, cfg_name)(**params, num_hidden_layers=layers,
                                          first_k_dense_replace=layers)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_name)._from_config(cfg, torch_dtype=dtype)
    return model.eval()


def cache_bytes(path: str, shape: dict, layers: int, length: int, elem: int) -> float:
    """Cache bytes one decode row reads per step at `length` tokens."""
    latent = (shape["kv_lora_rank"] + shape["qk_rope_head_dim"]) * elem
    if path == "dense":
        return layers * length * latent
    return layers * (length * shape["index_head_dim"] * elem
                     + min(length, shape["index_topk"]) * latent)


def run_path(path: str, args: argparse.Namespace, sizes: tuple[int, ...],
             lengths: tuple[int, ...]) -> list[dict]:
    """Rows of one attention path: every (length, batch) of the run."""
    from graphattn.models.hf import HFCausalLM

    model = build(path, SHAPES[args.shape], args.layers, args.device)
    hf = HFCausalLM(model)
    policy, max_len = replay_policy(sizes, lengths, args.steps)
    st = RequestState(max(sizes), max_len, BLOCK, args.device)
    hf.allocate_caches(st.num_kv_blocks, BLOCK)
    runner = GraphRunner(hf, st, RunnerConfig(policy=policy))
    report = runner.capture(progress=False)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    for i in range(max(sizes)):
        runner.add_request(f"r{i}", rng.integers(0, vocab, max(lengths) + 16))
    elem = 2 if args.device == "cuda" else 4
    rows = []
    for length in lengths:
        lens = rng.integers(length - 16, length + 16, max(sizes)).astype(np.int32)
        for n in sizes:
            sched = SchedulerOutput(np.arange(n, dtype=np.int32), np.ones(n, np.int32))
            replayed: list[bool] = []

            def step(i: int, sched: SchedulerOutput = sched, replayed: list = replayed) -> None:
                replayed.append(runner.step(sched).replayed)

            set_lengths(st, lens)
            times = step_times(step, args.steps, args.device, desc=f"{path} {n}/{length}")
            set_lengths(st, lens)
            rows.append({"path": path, "backend": runner.backend, "batch": n, "length": length,
                         **spread(times), "replayed": float(np.mean(replayed)),
                         "capture_s": report.seconds,
                         "cache_bytes_step": n * cache_bytes(path, SHAPES[args.shape],
                                                             args.layers, length, elem),
                         "host_syncs_per_step": syncs_per_step(lambda s=sched: runner.step(s))})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="v32", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the stack")
    ap.add_argument("--sizes", default="1,32,128", help="comma-separated batch sizes")
    ap.add_argument("--lengths", default="2048,16384", help="comma-separated cached lengths")
    ap.add_argument("--paths", default="sparse,dense", help="comma-separated: sparse, dense")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per row")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="folder for deepseek_step_DEVICE.json")
    args = ap.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    lengths = tuple(int(s) for s in args.lengths.split(","))
    rows = []
    with torch.inference_mode():
        for path in tqdm(args.paths.split(","), desc="deepseek_step", unit="path"):
            try:
                got = run_path(path, args, sizes, lengths)
            except Exception as e:  # noqa: BLE001 - recorded in the results, not hidden
                got = [{"path": path, "error": f"{type(e).__name__}: {e}"}]
            for row in got:
                rows.append(row)
                print(json.dumps(row), flush=True)
            gc.collect()  # the path's model, caches and graphs go before the next one's
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"deepseek_step_{args.device}.json").write_text(json.dumps(
            {"meta": result_meta("bench.deepseek_step", args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
