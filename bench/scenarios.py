"""Scenarios beyond uniform decode: mixed prefill+decode, spec decode with
rejections, ubatch split, and lengths spread across many buckets."""

from __future__ import annotations

import numpy as np

from bench.setup import fill_requests, make_setup, set_lengths
from bench.timing import spread, step_times
from graphattn import BucketPolicy
from graphattn.backends.paged import PagedAttentionBuilder
from graphattn.batch import prepare_inputs
from graphattn.capture.profiling import StageProfiler
from graphattn.metadata import build_common_metadata
from graphattn.spec_decode import RejectionFeedback, apply_rejections
from graphattn.state import SchedulerOutput
from graphattn.sync import count_host_syncs
from graphattn.transfer import to_device
from graphattn.ubatch import maybe_create_ubatch_slices, split_attn_metadata

STAGES = ("dispatch", "prepare", "replay", "eager", "postprocess")


def _timed_steps(step_fn, steps: int, device: str, desc: str = "steps") -> tuple[dict, float]:
    """(median / p25 / p75 µs per step, host syncs per step); syncs counted on 3 separate,
    untimed steps."""
    for i in range(3):
        step_fn(i)
    with count_host_syncs() as c:
        for i in range(3):
            step_fn(i)
    return spread(step_times(step_fn, steps, device, desc=desc)), c.count / 3


def _profiler() -> StageProfiler:
    return StageProfiler(nvtx_ranges=False, torch_labels=False, record_times=True)


def _stage_columns(runner) -> dict[str, float]:
    """Median host µs per stage of the runner's steps (its profiler records times)."""
    times = runner.profiler.times
    return {f"host_{s}_us": 1e6 * float(np.median(times[s])) for s in STAGES if times.get(s)}


def _row(scenario, mode, batch, timing, syncs, runner, report, **extra):
    return {"scenario": scenario, "mode": mode, "batch": batch, **timing,
            "syncs_per_step": syncs, "graphs": report.num_graphs, "capture_s": report.seconds,
            "pool_mb": report.pool_bytes / 2**20, "token_waste": runner.padding.token_waste,
            "len_waste": runner.padding.length_waste, **_stage_columns(runner), **extra}


def mixed(device: str, decodes: int = 32, chunk: int = 48, steps: int = 100) -> list[dict]:
    """Each step: `decodes` decode rows plus one prefill chunk of `chunk` tokens."""
    policy = BucketPolicy(capture_sizes=(decodes,), length_boundaries=(256, 512),
                          mixed_token_sizes=(64, 96, 128))
    rows = []
    for mode in ("host_read", "eager", "graphs"):
        setup = make_setup(device, decodes + 1, 1024, policy, profiler=_profiler())
        report = setup.runner.capture(progress=False) if mode == "graphs" else (
            setup.runner.graphs.capture([], lambda k: {}))
        rng = np.random.default_rng(1)
        fill_requests(setup, decodes, rng.integers(64, 256, decodes).astype(np.int32), rng)
        st, runner = setup.state, setup.runner
        prompt = rng.integers(0, setup.model.cfg.vocab_size, 1000)
        runner.add_request("prefill", prompt)
        pslot = st.req_id_to_slot["prefill"]
        slots = np.append(np.arange(decodes), pslot).astype(np.int32)

        def step(i, mode=mode, st=st, runner=runner, slots=slots, pslot=pslot):
            if st.num_computed_tokens_np[pslot] + chunk > 1000:
                st.num_computed_tokens_np[pslot] = 0
                st.num_computed_tokens[pslot : pslot + 1].fill_(0)
            sched = SchedulerOutput(slots, np.append(np.ones(decodes, np.int32), chunk))
            if mode == "host_read":
                int(st.num_computed_tokens[slots].max())
            runner.step(sched, force_eager=mode != "graphs")

        timing, syncs = _timed_steps(step, steps, device, f"mixed {mode}")
        rows.append(_row("mixed", mode, decodes, timing, syncs, runner, report))
    return rows


def spec_decode(device: str, batch: int = 32, k: int = 3, steps: int = 100) -> list[dict]:
    """Verify steps of 1 + k tokens, random rejections, feedback one step late."""
    policy = BucketPolicy(capture_sizes=(batch,), length_boundaries=(256, 512),
                          decode_query_len=k + 1)
    rows = []
    for mode in ("host_read", "eager", "graphs"):
        setup = make_setup(device, batch, 1024, policy, profiler=_profiler())
        report = setup.runner.capture(progress=False) if mode == "graphs" else (
            setup.runner.graphs.capture([], lambda key: {}))
        rng = np.random.default_rng(2)
        fill_requests(setup, batch, rng.integers(64, 256, batch).astype(np.int32), rng)
        st, runner = setup.state, setup.runner
        slots = np.arange(batch, dtype=np.int32)
        pending: list[RejectionFeedback] = []
        over = []

        def step(i, mode=mode, st=st, runner=runner, slots=slots, pending=pending, over=over,
                 rng=rng):
            if len(pending) > 1:
                apply_rejections(st, pending.pop(0))
            drafts = np.full(batch, k, np.int32)
            sched = SchedulerOutput(slots, drafts + 1, drafts)
            if mode == "host_read":  # learn the true lengths from the device
                int(st.num_computed_tokens[slots].max())
            out = runner.step(sched, force_eager=mode != "graphs")
            rejected = rng.integers(0, k + 1, batch).astype(np.int32)
            # the runner advanced device truth by all tokens: take the rejections back there
            st.num_computed_tokens.index_add_(0, to_device(slots.astype(np.int64), st.device),
                                              to_device(-rejected, st.device))
            pending.append(RejectionFeedback(slots, drafts, rejected))
            over.append(int(st.num_pending_drafts_np[slots].sum()))
            if st.num_computed_tokens_np[slots].max() > 900:
                lens = rng.integers(64, 256, batch).astype(np.int32)
                pending.clear()
                st.num_pending_drafts_np[slots] = 0
                set_lengths(st, lens)  # slots are 0..batch-1
            return out

        timing, syncs = _timed_steps(step, steps, device, f"spec_decode {mode}")
        rows.append(_row("spec_decode", mode, batch, timing, syncs, runner, report,
                         unverified_drafts=float(np.mean(over))))
    return rows


def ubatch_split(device: str, sizes: tuple[int, ...] = (64, 512), steps: int = 200) -> list[dict]:
    """Host cost of planning two micro-batches (split + build each), no device reads."""
    from graphattn.state import RequestState

    rows = []
    for n in sizes:
        st = RequestState(n, 2048, 16, device)
        bpr = st.max_num_blocks_per_req
        rng = np.random.default_rng(3)
        for i in range(n):
            st.add_request(f"r{i}", int(rng.integers(16, 1024)), np.arange(i * bpr, (i + 1) * bpr))
        q = rng.integers(1, 8, n).astype(np.int32)
        sched = SchedulerOutput(np.arange(n, dtype=np.int32), q)
        builder = PagedAttentionBuilder(16)

        def plan(_i=0, st=st, sched=sched, builder=builder):
            batch = prepare_inputs(st, sched)
            common = build_common_metadata(batch)
            slices = maybe_create_ubatch_slices(batch.query_start_loc_np, 2)
            return [builder.build(m) for m in split_attn_metadata(slices, common)]

        timing, syncs = _timed_steps(plan, steps, device, f"ubatch_split {n}")
        rows.append({"scenario": "ubatch_split", "mode": "plan", "batch": n, **timing,
                     "syncs_per_step": syncs})
    return rows


def many_lengths(device: str, batch: int = 32, steps: int = 300) -> list[dict]:
    """Decode with lengths spread over every bucket up to 2048; keys used and waste."""
    policy = BucketPolicy(capture_sizes=(8, 16, 32))
    setup = make_setup(device, batch, 2048, policy, profiler=_profiler())
    report = setup.runner.capture(progress=False)
    rng = np.random.default_rng(4)
    lengths = np.sort(rng.integers(8, 1700, batch)).astype(np.int32)
    fill_requests(setup, batch, lengths, rng)
    keys = set()

    def step(i):
        n = 8 + (i % 3) * 12  # 8, 20, 32 rows: several request paddings
        lo = int(rng.integers(0, batch - n + 1))
        out = setup.runner.step(SchedulerOutput(np.arange(lo, lo + n, dtype=np.int32),
                                                np.ones(n, np.int32)))
        keys.add(out.key)

    timing, syncs = _timed_steps(step, steps, device, "many_lengths")
    return [_row("many_lengths", "graphs", batch, timing, syncs, setup.runner, report,
                 keys_used=len(keys), eager_steps=int(None in keys))]


def graph_modes(device: str, steps: int = 60, decodes: int = 8,
                chunks: tuple[int, ...] = (24, 40)) -> list[dict]:
    """Mixed prefill + decode steps under every CUDAGraphMode, side by side.

    Each step: `decodes` decode rows plus one prefill chunk; every 4th step is a pure decode
    step. With a chunk of 24 a mixed step has 32 tokens: the full mixed key (32 tokens)
    exists, so the full modes replay it. With 40 the step has 48 tokens, more than the
    largest mixed key: the full modes run it eagerly and the piecewise modes replay pieces.
    """
    from graphattn.keys import CUDAGraphMode

    rows = []
    for chunk in chunks:
        for mode in CUDAGraphMode:
            rows.append(_graph_mode_row(device, mode, steps, decodes, chunk))
    return rows


def _graph_mode_row(device, mode, steps: int, decodes: int, chunk: int) -> dict:
    policy = BucketPolicy(capture_sizes=(decodes,), length_boundaries=(256, 512),
                          mixed_token_sizes=(32,), piecewise_token_sizes=(32, 64, 128))
    setup = make_setup(device, decodes + 1, 1024, policy, profiler=_profiler(), mode=mode)
    report = setup.runner.capture(progress=False)
    rng = np.random.default_rng(5)
    fill_requests(setup, decodes, rng.integers(64, 256, decodes).astype(np.int32), rng)
    st, runner = setup.state, setup.runner
    runner.add_request("prefill", rng.integers(0, setup.model.cfg.vocab_size, 1000))
    pslot = st.req_id_to_slot["prefill"]
    slots = np.append(np.arange(decodes), pslot).astype(np.int32)
    modes: list[str] = []

    def step(i):
        if st.num_computed_tokens_np[pslot] + chunk > 1000:
            st.num_computed_tokens_np[pslot] = 0
            st.num_computed_tokens[pslot : pslot + 1].fill_(0)
        if i % 4 == 3:
            out = runner.step(SchedulerOutput(slots[:-1], np.ones(decodes, np.int32)))
        else:
            out = runner.step(SchedulerOutput(slots, np.append(np.ones(decodes, np.int32),
                                                               chunk)))
        modes.append(out.mode.value)

    timing, syncs = _timed_steps(step, steps, device, f"graph_modes {mode.value} {chunk}")
    return _row("graph_modes", mode.value, decodes, timing, syncs, runner, report,
                chunk=chunk, step_modes=",".join(sorted(set(modes))),
                pieces=runner.piecewise.num_pieces if runner.piecewise else 0)
