"""Greedy agreement of a real model served through graphattn with its own `generate()`.

    python -m bench.real_agreement [--new 128] [--dtype bfloat16] [--device cuda] [--out DIR]

SmolLM2-135M-Instruct (`graphattn.models.real`, real weights: real logit margins) answers the
demo's four chat prompts greedily, `--new` tokens each, three ways in one process:
`graphattn` (`HFCausalLM` + `GraphRunner`, CUDA graphs, the four requests batched) and
transformers' own `generate()` (one request at a time), both in `--dtype`, and `generate()`
in float32 as the reference. Each row: the greedy agreement (tokens equal position by
position) and the first position where each request differs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench.fp8_kv import agreement, decode
from bench.setup import result_meta
from graphattn.demo import CHAT


def generate(model, prompts: list[np.ndarray], new: int) -> np.ndarray:
    """transformers' greedy `generate()`, one request at a time: tokens [requests, new]."""
    out = []
    for p in prompts:
        ids = torch.tensor(p, device=model.device)[None]
        out.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False,
                                  eos_token_id=None)[0, len(p):].tolist())
    return np.array(out)


def main() -> None:
    from graphattn.models.hf import HFCausalLM
    from graphattn.models.real import load_smollm2

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=128, help="tokens decoded per request")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="folder for real_agreement_DEVICE.json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model, tok = load_smollm2(device=args.device, dtype=torch.float32)
    prompts = [np.asarray(tok.apply_chat_template([{"role": "user", "content": c}],
                                                  add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]) for c in CHAT]
    with torch.inference_mode():
        ref = generate(model, prompts, args.new)
        model.to(dtype)
        hf = generate(model, prompts, args.new)
        ours, _ = decode(HFCausalLM(model), prompts, args.new, None, args.device)
    d = args.dtype
    rows = [{"compared": f"graphattn {d} vs generate() {d}", **agreement(ours, hf)},
            {"compared": f"graphattn {d} vs generate() float32", **agreement(ours, ref)},
            {"compared": f"generate() {d} vs generate() float32", **agreement(hf, ref)}]
    for r in rows:
        print(json.dumps(r), flush=True)
    print("graphattn:", [tok.decode(t) for t in ours[:2]])
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"real_agreement_{args.device}.json").write_text(json.dumps(
            {**result_meta("bench.real_agreement", args), "new_tokens": args.new,
             "requests": len(prompts), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
