"""End-to-end serving: requests arrive, tokens stream to the host one step late, requests
finish at their limit; graphs vs eager, speculative decoding on vs off, side by side.

    python -m bench.serving [--requests 64] [--device cuda] [--out bench/results]

Spec decoding uses an oracle proposer (the target's own greedy continuation, computed
beforehand by a plain greedy run of the same requests), so its rows show the ceiling of a
perfect drafter; the `graphs+ngram` row drafts inside the step with
`graphattn.proposer.NgramProposer` (no host round trip: tokens are still read one step
late, from `emitted_host`). `accept_rate` is measured, not assumed. Each row: tokens/s, p50 / p99
inter-token latency (host clock between a request's consecutive token arrivals), host idle
fraction (time the host spent blocked in `wait()` over the wall time), host syncs inside
step() (counted on the first steps).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from bench.setup import MODELS
from graphattn import GraphRunner, RunnerConfig
from graphattn.buckets import BucketPolicy
from graphattn.models.tiny import TinyDecoder
from graphattn.proposer import NgramProposer
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import count_host_syncs


def _workload(n: int, vocab: int, seed: int = 0) -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, vocab, int(rng.integers(16, 200))), int(rng.integers(16, 64)))
            for _ in range(n)]


def serve(model: TinyDecoder, device: str, work: list, mode: str, k: int,
          oracle: dict[int, list[int]] | None, max_reqs: int = 32,
          ngram: bool = False) -> tuple[dict, dict]:
    """Run every request of `work` to its limit; returns (row, generated tokens per request).
    Drafts of `k` tokens per decoding row come from `oracle` (host) or, with `ngram`, from
    an n-gram proposer inside the step."""
    q = k + 1 if oracle is not None or ngram else 1
    st = RequestState(max_reqs, 512, 16, device)
    if not model.caches:
        model.allocate_caches(max_reqs * st.max_num_blocks_per_req, 16)
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(
        capture_sizes=(1, 2, 4, 8, 16, 32), length_boundaries=(128, 256),
        mixed_token_sizes=(64, 128, 256), decode_query_len=q)),
        proposer=NgramProposer(n=2, window=64) if ngram else None)
    report = runner.capture(progress=False) if mode == "graphs" else None
    waiting = list(range(len(work)))
    slot_of: dict[int, int] = {}
    out_tokens: dict[int, list[int]] = {i: [] for i in range(len(work))}
    arrivals: dict[int, list[float]] = {i: [] for i in range(len(work))}
    pending = None
    blocked = syncs = accepted = drafted = steps = 0
    t0 = time.perf_counter()

    def consume(pending) -> None:
        nonlocal blocked, accepted, drafted
        p_ids, p_out, p_decoding = pending
        tw = time.perf_counter()
        toks = p_out.sampled_host.wait()
        rej = p_out.rejected_host.wait() if p_out.rejected_host is not None else None
        emitted = p_out.emitted_host.wait() if ngram and p_out.emitted_host is not None else None
        blocked += time.perf_counter() - tw
        if p_out.feedback is not None:
            runner.apply_feedback(p_out)
        now = time.perf_counter()
        for j, i in enumerate(p_ids):
            if i not in slot_of or not p_decoding[j]:
                continue
            new = [int(toks[j])]
            if rej is not None and p_out.feedback.num_draft_tokens[j]:
                d = int(p_out.feedback.num_draft_tokens[j])
                a = d - int(rej[j])
                accepted += a
                drafted += d
                if emitted is not None:
                    new = emitted[j][: a + 1].tolist()
                else:
                    have = len(out_tokens[i])
                    new = oracle[i][have + 1: have + 1 + a] + new
            out_tokens[i] += new
            arrivals[i].append(now)
            if len(out_tokens[i]) >= work[i][1]:
                st.remove_request(f"r{i}")
                del slot_of[i]

    while waiting or slot_of or pending is not None:
        if oracle is not None and pending is not None:
            # a CPU proposer drafts from the latest tokens: read them before scheduling
            consume(pending)
            pending = None
        while waiting and st.num_active < max_reqs:
            i = waiting.pop(0)
            slot_of[i] = runner.add_request(f"r{i}", work[i][0])
        ids = list(slot_of)
        slots = np.array([slot_of[i] for i in ids], np.int32)
        left = st.num_prompt_tokens_np[slots] - st.num_computed_tokens_np[slots]
        decoding = left <= 0
        drafts = np.zeros(len(ids), np.int32)
        flat: list[int] = []
        if oracle is not None:
            for j, i in enumerate(ids):  # the oracle proposer: the target's own continuation
                have = len(out_tokens[i])
                nxt = oracle[i][have + 1: have + 1 + k]
                if decoding[j] and len(nxt) == k:
                    drafts[j] = k
                    flat += nxt
        elif ngram:
            drafts[:] = np.where(decoding, k, 0)
        want = np.where(decoding, 1 + drafts, np.minimum(left, 128))
        room = np.maximum(256 - (np.cumsum(want) - want), 0)
        take = np.where(decoding, want, np.minimum(want, room))
        keep = take > 0
        out = None
        if keep.any():
            sched = SchedulerOutput(slots[keep], take[keep],
                                    np.where(decoding, drafts, 0)[keep]
                                    if oracle or ngram else None)
            kept_flat = [t for j in np.flatnonzero(keep & (drafts > 0))
                         for t in flat[k * int((drafts[:j] > 0).sum()): k * int(
                             (drafts[:j] > 0).sum()) + k]]
            with count_host_syncs() if steps < 5 else _nullcount() as c:
                out = runner.step(sched, force_eager=mode == "eager",
                                  draft_token_ids=kept_flat if oracle else None)
            syncs += c.count
            steps += 1
        if pending is not None:  # the previous step's tokens, one step late
            consume(pending)
        if out is not None:
            kept_ids = [i for i, kk in zip(ids, keep, strict=True) if kk]
            prefilled = (st.num_computed_tokens_np[sched.req_slots]
                         >= st.num_prompt_tokens_np[sched.req_slots])
            pending = (kept_ids, out, prefilled)
        else:
            pending = None
    wall = time.perf_counter() - t0
    gaps = np.concatenate([np.diff(a) for a in arrivals.values() if len(a) > 1])
    total = sum(min(len(v), work[i][1]) for i, v in out_tokens.items())
    row = {"mode": mode + ("+spec" if oracle is not None else "+ngram" if ngram else ""),
           "requests": len(work),
           "tokens": total, "tokens_per_s": total / wall, "itl_p50_ms": 1e3 * np.median(gaps),
           "itl_p99_ms": 1e3 * np.percentile(gaps, 99), "host_blocked_frac": blocked / wall,
           "syncs_per_step": syncs / max(min(steps, 5), 1), "steps": steps,
           "accept_rate": accepted / drafted if drafted else None,
           "capture_s": report.seconds if report else 0.0}
    return row, {i: v[: work[i][1]] for i, v in out_tokens.items()}


class _nullcount:
    count = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64,
                    help="requests to serve")
    ap.add_argument("--model", "--models", default="tiny",
                    help="bench model: tiny or 1b (a Llama-3.2-1B shape)")
    ap.add_argument("--spec", type=int, default=3, help="drafts per step in the spec rows")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                    help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--out", default=None,
                    help="folder for the result files")
    args = ap.parse_args()
    torch.manual_seed(0)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    model = TinyDecoder(MODELS[args.model]).to(args.device, dtype)
    work = _workload(args.requests, model.cfg.vocab_size)
    bar = tqdm(total=5, desc="serving", unit="run")

    def run(*a: object, **kw: object) -> tuple[dict, dict]:
        got = serve(model, args.device, work, *a, **kw)
        bar.set_postfix_str(got[0]["mode"])
        bar.update()
        return got

    rows = []
    greedy_row, greedy = run("graphs", 0, None)
    rows.append(greedy_row)
    oracle = {i: [work[i][0][-1]] + v for i, v in greedy.items()}  # last prompt token + output
    rows.append(run("eager", 0, None)[0])
    spec_row, spec_tokens = run("graphs", args.spec, oracle)
    spec_row["same_tokens_as_plain"] = spec_tokens == greedy
    rows.append(spec_row)
    rows.append(run("eager", args.spec, oracle)[0])
    ngram_row, ngram_tokens = run("graphs", args.spec, None, ngram=True)
    ngram_row["same_tokens_as_plain"] = ngram_tokens == greedy
    rows.append(ngram_row)
    bar.close()
    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "device":
            torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "model": args.model, "command": "python -m bench.serving " + " ".join(
                f"--{k} {v}" for k, v in vars(args).items() if k != "out")}
    for r in rows:
        print(json.dumps(r))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"serving_{args.device}_{args.dtype}.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
