"""Property tests: random schedules through prepare -> metadata -> ubatch."""

import numpy as np
import pytest

from bench.workload import SyntheticScheduler, WorkloadConfig, device_truth
from graphattn.batch import prepare_inputs
from graphattn.metadata import build_common_metadata
from graphattn.state import RequestState
from graphattn.sync import no_host_sync
from graphattn.ubatch import maybe_create_ubatch_slices, split_attn_metadata

CONFIGS = {
    "plain": WorkloadConfig(),
    "chunked": WorkloadConfig(prompt_len=(20, 90), token_budget=24),
    "spec_sync": WorkloadConfig(num_spec_tokens=3, feedback_delay=1),
    "spec_async": WorkloadConfig(num_spec_tokens=3, feedback_delay=2),
    "spec_late": WorkloadConfig(num_spec_tokens=4, feedback_delay=3, token_budget=32),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bound_is_upper_bound_and_exact_without_drafts(name, seed):
    cfg = CONFIGS[name]
    st = RequestState(max_num_reqs=6, max_model_len=160, block_size=8)
    ws = SyntheticScheduler(st, cfg, seed=seed)
    rng = np.random.default_rng(seed)
    over = 0
    for _ in range(150):
        sched = ws.next_schedule()
        pad_r = sched.num_reqs + int(rng.integers(0, 3))
        pad_t = sched.total_num_scheduled_tokens + int(rng.integers(0, 5))
        with no_host_sync():
            batch = prepare_inputs(st, sched, pad_r, pad_t)
            meta = build_common_metadata(batch)
            slices = maybe_create_ubatch_slices(batch.query_start_loc_np, 2, pad_t)
            parts = split_attn_metadata(slices, meta) if slices else [meta]
        truth = ws.true_seq_lens(sched)
        bound = batch.seq_lens_cpu_upper_bound_np[: sched.num_reqs]
        assert (bound >= truth).all()
        if cfg.num_spec_tokens == 0 or cfg.feedback_delay == 1:
            assert (bound == truth).all()
        over += int((bound > truth).sum())
        assert (batch.seq_lens_cpu_upper_bound_np[sched.num_reqs:] == 0).all()
        assert batch.seq_lens.numpy()[: sched.num_reqs].tolist() == truth.tolist()
        assert meta.max_seq_len == int(bound.max(initial=0))
        assert sum(p.num_actual_tokens for p in parts) == sched.total_num_scheduled_tokens
        for p in parts:
            assert (p.seq_lens_cpu_upper_bound.numpy() >= p.seq_lens.numpy()).all()
        ws.finish_step(sched)
        live = st.active_np
        assert (device_truth(st)[live] == ws.true_computed[live]).all()
        assert (st.num_computed_tokens_np[live] >= ws.true_computed[live]).all()
    if cfg.feedback_delay > 1:
        assert over > 0  # rejected drafts really made the bound over-estimate
    ws.deliver_feedback(force=True)
    live = st.active_np
    assert (st.num_computed_tokens_np[live] == ws.true_computed[live]).all()
    assert ws._next_id > 6  # requests joined and left


def test_whole_pipeline_on_meta_device():
    st = RequestState(max_num_reqs=4, max_model_len=128, block_size=4, device="meta")
    ws = SyntheticScheduler(st, WorkloadConfig(num_spec_tokens=2), seed=3)
    for _ in range(40):
        sched = ws.next_schedule()
        with no_host_sync():
            batch = prepare_inputs(st, sched, 4, 80)
            meta = build_common_metadata(batch)
            split_attn_metadata(maybe_create_ubatch_slices(batch.query_start_loc_np, 2, 80), meta)
        assert meta.slot_mapping.device.type == "meta"
        ws.finish_step(sched)
