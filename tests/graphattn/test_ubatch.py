import numpy as np
import pytest
import torch

from graphattn.batch import prepare_inputs
from graphattn.metadata import build_common_metadata
from graphattn.state import SchedulerOutput
from graphattn.sync import no_host_sync
from graphattn.ubatch import (
    UBatchSlice,
    make_metadata_with_slice,
    maybe_create_ubatch_slices,
    slice_query_start_locs,
    split_attn_metadata,
)
from tests.helpers import two_request_batch, two_request_state


def test_slice_query_start_locs():
    qsl = torch.tensor([0, 3, 9, 10], dtype=torch.int32)
    assert slice_query_start_locs(qsl, slice(1, 3)).tolist() == [0, 6, 7]
    with pytest.raises(ValueError, match="out of range for 3 requests"):
        slice_query_start_locs(qsl, slice(1, 4))


def test_split_inside_a_request_trims_query_and_last_length():
    _, _, _, m = two_request_batch()  # qsl [0,3,9,9,9], bound [7,6,0,0]
    parent_bound = m.seq_lens_cpu_upper_bound.clone()
    first, second = split_attn_metadata(
        [UBatchSlice(slice(0, 2), slice(0, 5)), UBatchSlice(slice(1, 4), slice(5, 12))], m
    )
    # first ends inside request 1 (tokens 3..4 of its 3..8): 4 query tokens dropped
    assert first.query_start_loc_cpu.tolist() == [0, 3, 5]
    assert first.query_start_loc.tolist() == [0, 3, 5]
    assert first.seq_lens_cpu_upper_bound.tolist() == [7, 2]
    assert first.seq_lens.tolist() == [7, 2]
    assert first._seq_lens_cpu.tolist() == [7, 2]
    assert first._num_computed_tokens_cpu.tolist() == [4, 0]
    assert (first.max_seq_len, first.max_query_len, first.num_actual_tokens) == (7, 3, 5)
    assert first.slot_mapping.tolist() == [12, 13, 14, 20, 21]
    # second starts inside request 1: its length stays, its context grows
    assert second.query_start_loc_cpu.tolist() == [0, 4, 4, 4]
    assert second.seq_lens_cpu_upper_bound.tolist() == [6, 0, 0]
    assert second._num_computed_tokens_cpu.tolist() == [2, 0, 0]
    assert (second.max_seq_len, second.max_query_len, second.num_actual_tokens) == (6, 4, 4)
    assert second.slot_mapping.tolist() == [22, 23, 36, 37, -1, -1, -1]
    assert second.block_table_tensor.shape[0] == 3
    # parent untouched
    assert torch.equal(m.seq_lens_cpu_upper_bound, parent_bound)
    assert m.seq_lens.tolist() == [7, 6, 0, 0]


def test_dummy_run_slice_keeps_parent_max_query_len():
    st = two_request_state()
    empty = SchedulerOutput(np.array([], np.int32), np.array([], np.int32))
    m = build_common_metadata(prepare_inputs(st, empty, 4, 8))
    m = m.__class__(**{**{f: getattr(m, f) for f in m.__dataclass_fields__}, "max_query_len": 2})
    s = make_metadata_with_slice(UBatchSlice(slice(0, 2), slice(0, 4)), m)
    assert s.max_query_len == 2 and s.num_actual_tokens == 0 and s.max_seq_len == 0


def test_bad_slices():
    _, _, _, m = two_request_batch()
    with pytest.raises(ValueError, match="step 1"):
        UBatchSlice(slice(0, 2, 2), slice(0, 1))
    with pytest.raises(ValueError, match="start and stop"):
        UBatchSlice(slice(None, 2), slice(0, 1))
    with pytest.raises(ValueError, match="0 <= start <= stop"):
        UBatchSlice(slice(3, 2), slice(0, 1))
    with pytest.raises(ValueError, match="metadata has 4 requests"):
        make_metadata_with_slice(UBatchSlice(slice(0, 5), slice(0, 1)), m)
    with pytest.raises(ValueError, match="metadata has 12 tokens"):
        make_metadata_with_slice(UBatchSlice(slice(0, 1), slice(0, 13)), m)
    with pytest.raises(ValueError, match="not inside the tokens"):
        make_metadata_with_slice(UBatchSlice(slice(1, 2), slice(0, 4)), m)


def test_maybe_create_ubatch_slices():
    qsl = np.array([0, 3, 9, 9, 9])
    assert maybe_create_ubatch_slices(qsl, 1) is None
    assert maybe_create_ubatch_slices(np.array([0, 1]), 2) is None
    s = maybe_create_ubatch_slices(qsl, 2, 12)
    assert s == [UBatchSlice(slice(0, 2), slice(0, 6)), UBatchSlice(slice(1, 4), slice(6, 12))]
    s = maybe_create_ubatch_slices(qsl, 3, 9)
    assert [(u.request_slice, u.token_slice) for u in s] == [
        (slice(0, 1), slice(0, 3)), (slice(1, 2), slice(3, 6)), (slice(1, 4), slice(6, 9))]
    dummy = maybe_create_ubatch_slices(np.zeros(5, np.int32), 2, 8)
    assert dummy == [UBatchSlice(slice(0, 0), slice(0, 4)), UBatchSlice(slice(0, 4), slice(4, 8))]
    with pytest.raises(ValueError, match="num_ubatches = 0"):
        maybe_create_ubatch_slices(qsl, 0)
    with pytest.raises(ValueError, match="below the real tokens 9"):
        maybe_create_ubatch_slices(qsl, 2, 8)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_slices_cover_batch_under_no_host_sync(device):
    _, _, b, m = two_request_batch(device=device)
    with no_host_sync():
        slices = maybe_create_ubatch_slices(b.query_start_loc_np, 2, b.num_tokens_padded)
        parts = split_attn_metadata(slices, m)
    assert sum(p.num_actual_tokens for p in parts) == m.num_actual_tokens
    assert sum(p.slot_mapping.shape[0] for p in parts) == m.num_tokens_padded


def test_slices_that_would_read_wrong_kv_are_refused():
    _, _, _, m = two_request_batch()  # qsl [0,3,9,9,9]
    with pytest.raises(ValueError, match=r"not inside the tokens \[0, 3\).*later requests follow"):
        make_metadata_with_slice(UBatchSlice(slice(0, 1), slice(0, 12)), m)
    with pytest.raises(ValueError, match=r"leaves request 0 .* with no query token"):
        make_metadata_with_slice(UBatchSlice(slice(0, 2), slice(3, 9)), m)
    with pytest.raises(ValueError, match="consecutive and increasing"):
        split_attn_metadata([UBatchSlice(slice(1, 4), slice(5, 12)),
                             UBatchSlice(slice(0, 2), slice(0, 5))], m)
    with pytest.raises(ValueError, match=r"query_start_loc must be 1-D with num_reqs \+ 1 >= 1"):
        slice_query_start_locs(torch.zeros(0, dtype=torch.int32), slice(0, 0))
    # the padded tail may follow the last real request
    tail = make_metadata_with_slice(UBatchSlice(slice(1, 4), slice(3, 12)), m)
    assert tail.query_start_loc_cpu.tolist() == [0, 6, 6, 6]


@pytest.mark.parametrize("qsl,match", [
    (np.array([], np.int32), "1-D integer with num_reqs_padded"),
    (np.array([[0, 2]]), "1-D integer"),
    (np.array([0.0, 2.0]), "1-D integer"),
    (np.array([0, 4, 2]), "start at 0 and never decrease"),
    (np.array([1, 4]), "start at 0"),
])
def test_bad_query_start_locs_are_refused(qsl, match):
    with pytest.raises(ValueError, match=match):
        maybe_create_ubatch_slices(qsl, 2)


@pytest.mark.parametrize("n", [0, 2.5, True])
def test_bad_micro_batch_counts_are_refused(n):
    with pytest.raises(ValueError, match="num_ubatches"):
        maybe_create_ubatch_slices(np.array([0, 4]), n)


def test_a_block_table_without_columns_is_refused():
    import dataclasses

    m = two_request_batch()[3]
    n = m.num_reqs
    with pytest.raises(ValueError, match=rf"block_table_tensor has shape \({n}, 0\), expected "
                                         rf"\({n}, max_num_blocks\) with max_num_blocks >= 1"):
        dataclasses.replace(m, block_table_tensor=m.block_table_tensor[:, :0])
