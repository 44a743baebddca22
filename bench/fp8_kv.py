"""Accuracy of the fp8 KV cache: the same requests decoded greedily with the cache in the
model's dtype and in float8_e4m3fn, side by side in one process, with scales 1 and with
per-layer scales calibrated on other prompts (`kv_scales()` after serving them with a
model-dtype cache: each layer's max |K| and max |V| / 448).

    python -m bench.fp8_kv [--models tiny,smollm2] [--new 200] [--device cpu] [--out DIR]

Models: `tiny` and `1b` (random weights, random 32-token prompts), `smollm2`
(SmolLM2-135M-Instruct, `graphattn.models.real`, four chat prompts). Each row: the greedy
agreement (tokens equal to the model-dtype cache's, position by position over `--new`
tokens per request), the first position where a request's tokens differ, and the largest
logit difference while the two runs still fed the same tokens (and that logit range). For
`smollm2` also the format's own effect: transformers' SDPA forward on the first prompt with
K and V rounded through float8_e4m3fn, against the plain forward (last-token logits).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench.setup import MODELS, result_meta
from graphattn import BucketPolicy, GraphRunner, RequestState, RunnerConfig, SchedulerOutput
from graphattn.demo import CHAT
from graphattn.models.tiny import TinyDecoder


def decode(model, prompts: list[np.ndarray], new: int, kv_cache_dtype, device: str,
           kv_scales=None):
    """Greedy tokens [requests, new] and their logits [requests, new, vocab] (float32)."""
    bs = 16
    state = RequestState(len(prompts), max(len(p) for p in prompts) + new + 1, bs, device)
    model.allocate_caches(state.num_kv_blocks, bs, kv_cache_dtype, kv_scales)
    runner = GraphRunner(model, state, RunnerConfig(policy=BucketPolicy(
        capture_sizes=(len(prompts),), length_boundaries=(state.max_model_len,))))
    runner.capture(progress=False)
    slots = np.array([runner.add_request(f"r{i}", p) for i, p in enumerate(prompts)], np.int32)
    tokens, logits = [], []
    for s, p in zip(slots, prompts, strict=True):  # prefill one by one
        out = runner.step(SchedulerOutput(np.array([s]), np.array([len(p)])))
        tokens.append([int(out.sampled[0])])
        logits.append([out.logits[0].float().cpu()])
    for _ in range(new - 1):
        out = runner.step(SchedulerOutput(slots, np.ones(len(slots), np.int32)))
        for j in range(len(prompts)):
            tokens[j].append(int(out.sampled[j]))
            logits[j].append(out.logits[j].float().cpu())
    return np.array(tokens), torch.stack([torch.stack(x) for x in logits])


def agreement(a: np.ndarray, b: np.ndarray) -> dict:
    """Greedy agreement of two runs' tokens [requests, new]: the share of equal positions,
    and each request's first differing position (`new` where none differs)."""
    same = a == b
    return {"greedy_agreement": float(same.mean()),
            "first_difference": [int(np.argmin(r)) if not r.all() else len(r) for r in same]}


def compare(name: str, model, prompts: list[np.ndarray], calibration: list[np.ndarray],
            new: int, device: str) -> list[dict]:
    """Rows of the fp8 cache with scales 1 and with calibrated scales against the
    model-dtype cache."""
    with torch.inference_mode():
        decode(model, calibration, 1, None, device)  # prefills into model-dtype caches
        scales = model.kv_scales()
        base_t, base_l = decode(model, prompts, new, None, device)
        runs = {"1": decode(model, prompts, new, "fp8_e4m3", device),
                "calibrated": decode(model, prompts, new, "fp8_e4m3", device, scales)}
    rows = []
    for kind, (fp8_t, fp8_l) in runs.items():
        agree = agreement(base_t, fp8_t)
        first = agree["first_difference"]
        err = max(float((base_l[j, : first[j] + 1] - fp8_l[j, : first[j] + 1]).abs().max())
                  for j in range(len(prompts)))
        rows.append({"model": name, "scales": kind, "requests": len(prompts),
                     "new_tokens": new, **agree, "max_logit_diff_before_difference": err,
                     "logit_range": float(base_l.max() - base_l.min())})
    rows[-1]["k_scales"] = [k for k, _ in scales]
    rows[-1]["v_scales"] = [v for _, v in scales]
    return rows


def roundtrip_logit_diff(model, prompt: np.ndarray) -> float:
    """Max |logit difference| of transformers' own SDPA forward with K and V rounded
    through float8_e4m3fn against the plain one (the last token of `prompt`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def rounded(module, q, k, v, *args, **kwargs):
        fp8 = torch.float8_e4m3fn
        return sdpa(module, q, k.to(fp8).to(k.dtype), v.to(fp8).to(v.dtype), *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["fp8_roundtrip"] = rounded
    cfg, ids = model.config, torch.tensor(prompt, device=model.device)[None]
    before = cfg._attn_implementation
    try:
        with torch.inference_mode():
            cfg._attn_implementation = "sdpa"
            plain = model(ids).logits[0, -1].float()
            cfg._attn_implementation = "fp8_roundtrip"
            return float((model(ids).logits[0, -1].float() - plain).abs().max())
    finally:
        cfg._attn_implementation = before


# calibration prompts: other requests than the measured ones
CALIBRATION = ["Summarize the plot of a famous novel in two sentences.",
               "How does a refrigerator keep food cold?",
               "Give me a short packing list for a weekend hike.",
               "Translate 'good morning' into French and Spanish."]


def load(name: str, device: str):
    """(model, prompts, calibration prompts) of `name`."""
    if name == "smollm2":
        from graphattn.models.hf import HFCausalLM
        from graphattn.models.real import load_smollm2

        model, tok = load_smollm2(device=device)
        prompts, calibration = ([np.asarray(tok.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True,
            return_dict=True)["input_ids"]) for c in texts] for texts in (CHAT, CALIBRATION))
        return HFCausalLM(model), prompts, calibration
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = TinyDecoder(MODELS[name]).to(device, dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, MODELS[name].vocab_size, 32) for _ in range(8)]
    return model, prompts[:4], prompts[4:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, 1b, "
                    "smollm2")
    ap.add_argument("--new", type=int, default=200, help="tokens decoded per request")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="folder for fp8_kv_DEVICE.json")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        model, prompts, calibration = load(name, args.device)
        got = compare(name, model, prompts, calibration, args.new, args.device)
        if name == "smollm2":
            got[0]["transformers_fp8_roundtrip_logit_diff"] = roundtrip_logit_diff(
                model.model, prompts[0])
        for row in got:
            print(json.dumps(row), flush=True)
        rows += got
    if args.out:
        meta = result_meta("bench.fp8_kv", args)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"fp8_kv_{args.device}.json").write_text(
            json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
