"""The benchmark model and runner (shared by every scenario)."""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
from dataclasses import dataclass

import numpy as np
import torch

from graphattn import BucketPolicy, GraphRunner, RunnerConfig
from graphattn.keys import CUDAGraphMode
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState

BENCH_MODEL = TinyConfig(vocab_size=4096, hidden_size=1024, num_layers=8, num_heads=16,
                         num_kv_heads=4, intermediate_size=2816)
# a 1B-class Llama shape (random weights)
LLAMA_1B = TinyConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                      num_kv_heads=8, intermediate_size=8192, rope_theta=500000.0)
MODELS = {"tiny": BENCH_MODEL, "1b": LLAMA_1B}


def hf_llama(device: str | torch.device, dtype: torch.dtype, cfg: TinyConfig = LLAMA_1B,
             seed: int = 0) -> torch.nn.Module:
    """A transformers `LlamaForCausalLM` of `cfg`'s shape (tied embeddings, random weights),
    wrapped in `HFCausalLM`."""
    import transformers

    from graphattn.models.hf import HFCausalLM

    torch.manual_seed(seed)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        rope_theta=cfg.rope_theta, max_position_embeddings=4096, tie_word_embeddings=True)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_cfg).to(dtype).eval()
    return HFCausalLM(model)


@dataclass(slots=True)
class Setup:
    model: TinyDecoder
    state: RequestState
    runner: GraphRunner


def make_setup(device: str, max_reqs: int, max_len: int, policy: BucketPolicy,
               cfg: TinyConfig = BENCH_MODEL, block_size: int = 16, seed: int = 0,
               model: TinyDecoder | None = None, *, compile: bool = False,
               mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE,
               **runner_kwargs) -> Setup:
    """Model (bf16 on CUDA; shared when given), state, caches and a GraphRunner of
    `RunnerConfig(policy, compile, cudagraph_mode=mode)`; `runner_kwargs` go to
    `GraphRunner` (``profiler=``)."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if model is None:
        model = TinyDecoder(cfg).to(device, dtype)
    st = RequestState(max_reqs, max_len, block_size, device)
    if not model.caches:
        model.allocate_caches(max_reqs * st.max_num_blocks_per_req, block_size)
    config = RunnerConfig(policy=policy, compile=compile, cudagraph_mode=mode)
    return Setup(model, st, GraphRunner(model, st, config, **runner_kwargs))


def set_lengths(state: RequestState, lengths: np.ndarray) -> None:
    """Put requests 0..len(lengths)-1 at these computed lengths, CPU mirror and device alike."""
    n = lengths.shape[0]
    state.num_computed_tokens_np[:n] = lengths
    state.num_computed_tokens[:n].copy_(torch.from_numpy(lengths.astype(np.int32)))


def fill_requests(setup: Setup, n: int, lengths: np.ndarray, rng: np.random.Generator) -> None:
    """Admit n requests whose prompts are already computed (lengths[i] tokens in the cache)."""
    st = setup.state
    for i in range(n):
        setup.runner.add_request(f"r{i}", rng.integers(0, setup.model.cfg.vocab_size,
                                                       int(lengths[i])))
    set_lengths(st, lengths[:n])


def add_shape_options(ap: argparse.ArgumentParser, steps: bool = True) -> None:
    """The decode-shape options the GPU benchmarks share: --sizes, --lengths (and --steps)."""
    ap.add_argument("--sizes", default="1,8,32,128",
                    help="comma-separated batch sizes (requests per step)")
    ap.add_argument("--lengths", default="512,2048",
                    help="comma-separated context lengths (tokens per request)")
    if steps:
        ap.add_argument("--steps", type=int, default=100, help="timed steps per point")


def result_meta(module: str, args: argparse.Namespace,
                device: str | None = None) -> dict[str, str]:
    """What a result file says of its run: date, torch and Triton versions, device (`device`,
    else ``args.device``; "cuda" is written as the GPU's name) and the command that repeats
    it (every option given but --out)."""
    cuda = (device or getattr(args, "device", "cpu")) == "cuda"
    opts = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                    for k, v in vars(args).items()
                    if k != "out" and v is not None and v is not False)
    triton = importlib.util.find_spec("triton")
    return {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": importlib.import_module("triton").__version__ if triton else "none",
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "command": f"python -m {module} {opts}"}
