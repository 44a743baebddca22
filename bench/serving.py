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

from bench.setup import MODELS, result_meta
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
    return _ServingLoop(model, device, work, mode, k, oracle, max_reqs, ngram).run()


class _ServingLoop:
    """One `serve` run: admission, chunked prefill within a token budget, drafts, and each
    step's tokens read one step late."""

    def __init__(self, model: TinyDecoder, device: str, work: list, mode: str, k: int,
                 oracle: dict[int, list[int]] | None, max_reqs: int, ngram: bool) -> None:
        self.work, self.mode, self.k, self.oracle, self.ngram = work, mode, k, oracle, ngram
        self.max_reqs = max_reqs
        q = k + 1 if oracle is not None or ngram else 1
        self.st = RequestState(max_reqs, 512, 16, device)
        if not model.caches:
            model.allocate_caches(max_reqs * self.st.max_num_blocks_per_req, 16)
        self.runner = GraphRunner(model, self.st, RunnerConfig(policy=BucketPolicy(
            capture_sizes=(1, 2, 4, 8, 16, 32), length_boundaries=(128, 256),
            mixed_token_sizes=(64, 128, 256), decode_query_len=q)),
            proposer=NgramProposer(n=2, window=64) if ngram else None)
        self.report = self.runner.capture(progress=False) if mode == "graphs" else None
        self.waiting = list(range(len(work)))
        self.slot_of: dict[int, int] = {}
        self.out_tokens: dict[int, list[int]] = {i: [] for i in range(len(work))}
        self.arrivals: dict[int, list[float]] = {i: [] for i in range(len(work))}
        self.blocked = 0.0
        self.syncs = self.accepted = self.drafted = self.steps = 0

    def run(self) -> tuple[dict, dict]:
        t0 = time.perf_counter()
        pending = None
        while self.waiting or self.slot_of or pending is not None:
            if self.oracle is not None and pending is not None:
                # a CPU proposer drafts from the latest tokens: read them before scheduling
                self._consume(pending)
                pending = None
            self._admit()
            ids = list(self.slot_of)
            sched, flat, rows = self._schedule(ids)
            out = self._step(sched, flat) if sched is not None else None
            if pending is not None:  # the previous step's tokens, one step late
                self._consume(pending)
            pending = None if out is None else (
                [ids[j] for j in rows], out,
                self.st.num_computed_tokens_np[sched.req_slots]
                >= self.st.num_prompt_tokens_np[sched.req_slots])
        tokens = {i: v[: self.work[i][1]] for i, v in self.out_tokens.items()}
        return self._row(time.perf_counter() - t0), tokens

    def _admit(self) -> None:
        while self.waiting and self.st.num_active < self.max_reqs:
            i = self.waiting.pop(0)
            self.slot_of[i] = self.runner.add_request(f"r{i}", self.work[i][0])

    def _schedule(self, ids: list[int]
                  ) -> tuple[SchedulerOutput | None, list[int], np.ndarray]:
        """The step's schedule (None: nothing fits), its host drafts flattened, and the
        positions in `ids` of its rows. Prefill chunks of up to 128 tokens fill a
        256-token budget after the decoding rows."""
        st, k = self.st, self.k
        slots = np.array([self.slot_of[i] for i in ids], np.int32)
        left = st.num_prompt_tokens_np[slots] - st.num_computed_tokens_np[slots]
        decoding = left <= 0
        drafts = np.zeros(len(ids), np.int32)
        flat: list[list[int]] = []
        if self.oracle is not None:
            for j, i in enumerate(ids):  # the oracle proposer: the target's own continuation
                have = len(self.out_tokens[i])
                nxt = self.oracle[i][have + 1: have + 1 + k]
                if decoding[j] and len(nxt) == k:
                    drafts[j] = k
                    flat.append(nxt)
        elif self.ngram:
            drafts[:] = np.where(decoding, k, 0)
        want = np.where(decoding, 1 + drafts, np.minimum(left, 128))
        room = np.maximum(256 - (np.cumsum(want) - want), 0)
        take = np.where(decoding, want, np.minimum(want, room))
        keep = take > 0
        rows = np.flatnonzero(keep)
        if not rows.size:
            return None, [], rows
        sched = SchedulerOutput(slots[keep], take[keep], np.where(decoding, drafts, 0)[keep]
                                if self.oracle or self.ngram else None)
        # the host drafts of the kept rows, in batch order (the n-gram proposer drafts in the
        # step)
        kept = [t for r, j in enumerate(np.flatnonzero(drafts > 0)) if keep[j]
                for t in flat[r]] if self.oracle is not None else []
        return sched, kept, rows

    def _step(self, sched: SchedulerOutput, flat: list[int]) -> object:
        with count_host_syncs() if self.steps < 5 else _nullcount() as c:
            out = self.runner.step(sched, force_eager=self.mode == "eager",
                                   draft_token_ids=flat if self.oracle else None)
        self.syncs += c.count
        self.steps += 1
        return out

    def _consume(self, pending: tuple) -> None:
        """Read a step's tokens (and accepted drafts) and retire requests at their limit."""
        p_ids, p_out, p_decoding = pending
        tw = time.perf_counter()
        toks = p_out.sampled_host.wait()
        rej = p_out.rejected_host.wait() if p_out.rejected_host is not None else None
        emitted = (p_out.emitted_host.wait() if self.ngram and p_out.emitted_host is not None
                   else None)
        self.blocked += time.perf_counter() - tw
        if p_out.feedback is not None:
            self.runner.apply_feedback(p_out)
        now = time.perf_counter()
        for j, i in enumerate(p_ids):
            if i not in self.slot_of or not p_decoding[j]:
                continue
            new = [int(toks[j])]
            if rej is not None and p_out.feedback.num_draft_tokens[j]:
                d = int(p_out.feedback.num_draft_tokens[j])
                a = d - int(rej[j])
                self.accepted += a
                self.drafted += d
                if emitted is not None:
                    new = emitted[j][: a + 1].tolist()
                else:
                    have = len(self.out_tokens[i])
                    new = self.oracle[i][have + 1: have + 1 + a] + new
            self.out_tokens[i] += new
            self.arrivals[i].append(now)
            if len(self.out_tokens[i]) >= self.work[i][1]:
                self.st.remove_request(f"r{i}")
                del self.slot_of[i]

    def _row(self, wall: float) -> dict:
        gaps = np.concatenate([np.diff(a) for a in self.arrivals.values() if len(a) > 1])
        total = sum(min(len(v), self.work[i][1]) for i, v in self.out_tokens.items())
        suffix = "+spec" if self.oracle is not None else "+ngram" if self.ngram else ""
        return {"mode": self.mode + suffix, "requests": len(self.work), "tokens": total,
                "tokens_per_s": total / wall, "itl_p50_ms": 1e3 * np.median(gaps),
                "itl_p99_ms": 1e3 * np.percentile(gaps, 99),
                "host_blocked_frac": self.blocked / wall,
                "syncs_per_step": self.syncs / max(min(self.steps, 5), 1), "steps": self.steps,
                "accept_rate": self.accepted / self.drafted if self.drafted else None,
                "capture_s": self.report.seconds if self.report else 0.0}


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
    meta = {**result_meta("bench.serving", args), "model": args.model}
    for r in rows:
        print(json.dumps(r))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, f"serving_{args.device}_{args.dtype}.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
