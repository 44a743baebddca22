import numpy as np
import pytest

from graphattn.batch import prepare_inputs
from graphattn.state import SchedulerOutput
from graphattn.sync import no_host_sync
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
    assert b.block_table[:, :3].tolist() == [[2, 3, 0], [5, 9, 0], [0, 0, 0], [0, 0, 0]]
    assert b.query_start_loc.tolist() == [0, 3, 9, 9, 9]
    assert (b.max_query_len, b.max_seq_len, b.seq_lens_exact) == (6, 7, True)
    assert b.req_slots.tolist() == [1, 0] and b.num_scheduled.tolist() == [3, 6]


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
    st.num_computed_tokens_np[0] = 20  # mirror over-estimates (pending drafts)
    st.num_pending_drafts_np[0] = 2
    b = prepare_inputs(st, SchedulerOutput(np.array([0]), np.array([3])))
    assert b.seq_lens_cpu_upper_bound_np.tolist() == [23]
    assert b.seq_lens.tolist() == [3]  # truth from the device
    assert not b.seq_lens_exact
