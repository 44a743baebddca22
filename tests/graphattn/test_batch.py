import numpy as np
import pytest
import torch

from graphattn.batch import BatchPlan, assemble_batch, plan_batch, prepare_inputs
from graphattn.state import SchedulerOutput
from graphattn.sync import no_host_sync
from graphattn.transfer import StagingRing
from tests.helpers import two_request_batch, two_request_state


def test_hand_computed_batch():
    with no_host_sync():
        _, _, b, _ = two_request_batch()
    assert b.query_start_loc_np.tolist() == [0, 3, 9, 9, 9]
    assert b.seq_lens_cpu_upper_bound_np.tolist() == [7, 6, 0, 0]
    assert b.req_indices_np.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    assert b.positions.tolist() == [4, 5, 6, 0, 1, 2, 3, 4, 5, 0, 0, 0]
    assert b.slot_mapping.tolist() == [12, 13, 14, 20, 21, 22, 23, 36, 37, -1, -1, -1]
    assert b.seq_lens.tolist() == [7, 6, 0, 0]
    # entries past a request's blocks point at the sink (block 32); padded rows are 0
    assert b.block_table[:, :3].tolist() == [[2, 3, 32], [5, 9, 32], [0, 0, 0], [0, 0, 0]]
    assert b.query_start_loc.tolist() == [0, 3, 9, 9, 9]
    assert (b.max_query_len, b.max_seq_len, b.seq_lens_exact) == (6, 7, True)
    assert b.req_slots.tolist() == [1, 0, 0, 0] and b.num_scheduled.tolist() == [3, 6, 0, 0]


def test_unpadded_default():
    st = two_request_state()
    b = prepare_inputs(st, SchedulerOutput(np.array([0]), np.array([2])))
    assert (b.num_reqs_padded, b.num_tokens_padded) == (1, 2)
    assert b.slot_mapping.tolist() == [20, 21]


def test_empty_batch_and_dummy_run():
    st = two_request_state()
    empty = SchedulerOutput(np.array([], np.int32), np.array([], np.int32))
    with no_host_sync():
        b = prepare_inputs(st, empty)
        d = prepare_inputs(st, empty, 8, 8)  # all rows padded (a dummy run)
    assert b.num_reqs == 0 and b.query_start_loc_np.tolist() == [0]
    assert b.max_seq_len == 0 and b.max_query_len == 0
    assert d.query_start_loc_np.tolist() == [0] * 9
    assert d.seq_lens_cpu_upper_bound_np.tolist() == [0] * 8
    assert d.slot_mapping.tolist() == [-1] * 8
    assert d.seq_lens.tolist() == [0] * 8


def test_meta_device_pipeline():
    with no_host_sync():
        _, _, b, m = two_request_batch(device="meta")
    assert b.slot_mapping.device.type == "meta" and m.seq_lens.device.type == "meta"
    assert b.seq_lens_cpu_upper_bound_np.tolist() == [7, 6, 0, 0]
    assert m.max_seq_len == 7


@pytest.mark.parametrize(
    "reqs_p, toks_p, match",
    [(1, 12, "num_reqs_padded = 1 is below num_reqs = 2"),
     (4, 8, "num_tokens_padded = 8 is below num_tokens = 9")],
)
def test_padding_below_real_rejected(reqs_p, toks_p, match):
    st = two_request_state()
    with pytest.raises(ValueError, match=match):
        prepare_inputs(st, SchedulerOutput(np.array([1, 0]), np.array([3, 6])), reqs_p, toks_p)


def test_largest_bound_is_vectorized_np_add():
    st = two_request_state()
    st.append_blocks("a", [10, 11, 12, 13])  # room for 24 tokens
    st.num_computed_tokens_np[0] = 20  # mirror over-estimates (pending drafts)
    st.num_pending_drafts_np[0] = 2
    b = prepare_inputs(st, SchedulerOutput(np.array([0]), np.array([3])))
    assert b.seq_lens_cpu_upper_bound_np.tolist() == [23]
    assert b.seq_lens.tolist() == [3]  # truth from the device
    assert not b.seq_lens_exact


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_device_half_reads_padded_sizes_only(device):
    """What a captured graph relies on: the device half recorded for a dummy plan
    gives the live batch's tensors when fed the live packed buffer."""
    st = two_request_state(device)
    sched = SchedulerOutput(np.array([1, 0]), np.array([3, 6]))
    empty = SchedulerOutput(np.array([], np.int32), np.array([], np.int32))
    live, dummy = plan_batch(st, sched, 4, 12), plan_batch(st, empty, 4, 12)
    with no_host_sync():
        got = assemble_batch(st, dummy, live.packed.to(device))
        want = prepare_inputs(st, sched, 4, 12)
    assert got.num_reqs == 0  # the CPU fields are the dummy plan's
    for name in ("query_start_loc", "seq_lens", "positions", "slot_mapping", "block_table",
                 "req_indices", "token_slots", "req_slots", "num_scheduled"):
        t, ref = getattr(got, name), getattr(want, name)
        assert t.shape == ref.shape and t.dtype == ref.dtype, name
        if device == "cpu":
            assert torch.equal(t, ref), name


def test_plan_is_cpu_only_and_validated():
    st = two_request_state()
    plan = plan_batch(st, SchedulerOutput(np.array([1, 0]), np.array([3, 6])), 4, 12)
    assert plan.packed.device.type == "cpu" and plan.packed.dtype == torch.int32
    assert plan.token_offsets_np.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 0, 0]
    assert (plan.max_query_len, plan.max_seq_len) == (6, 7)
    with pytest.raises(ValueError, match=r"packed is torch.int32 \(5,\), expected torch.int32 "
                                         r"\(61,\)"):
        BatchPlan(2, 4, 9, 12, torch.zeros(5, dtype=torch.int32), True)
    with pytest.raises(ValueError, match="num_tokens = 13, expected in"):
        BatchPlan(2, 4, 13, 12, plan.packed, True)


class _DoneEvent:
    def record(self, stream=None):
        pass

    def query(self):
        return True


def test_a_reused_plan_is_refilled_whole():
    """Plans come back from the staging ring with the last schedule's values: every field
    of the next plan of the same padded sizes is rewritten (drafts, offsets, padding)."""
    st = two_request_state()
    ring = StagingRing("cpu")
    ring.cuda, ring._event = True, _DoneEvent  # the CUDA reuse, with host buffers
    spec = SchedulerOutput(np.array([1, 0]), np.array([3, 2]), np.array([2, 1]))
    plain = SchedulerOutput(np.array([0]), np.array([1]))
    with no_host_sync():
        first = plan_batch(st, spec, 4, 12, draft_token_ids=np.array([7, 8, 9]), staging=ring)
        ring.release((4, 12), first)
        again = plan_batch(st, plain, 4, 12, staging=ring)
    fresh = plan_batch(st, plain, 4, 12)
    assert again is first and torch.equal(again.packed, fresh.packed)
    assert again.draft_ids_np.tolist() == [-1] * 12 and again.num_draft_tokens_np.sum() == 0
    assert (again.num_reqs, again.num_tokens, again.seq_lens_exact) == (1, 1, True)
