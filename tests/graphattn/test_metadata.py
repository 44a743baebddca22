import dataclasses
import warnings

import pytest
import torch

from graphattn.sync import HostSyncError, no_host_sync
from tests.helpers import two_request_batch


def test_fields_from_batch():
    _, _, b, m = two_request_batch()
    assert m.num_reqs == 4 and m.num_actual_tokens == 9 and m.num_tokens_padded == 12
    assert (m.max_query_len, m.max_seq_len) == (6, 7)
    assert m.query_lens_cpu.tolist() == [3, 6, 0, 0]
    assert m.num_computed_tokens_cpu_upper_bound.tolist() == [4, 0, 0, 0]
    assert m.seq_lens_cpu_upper_bound.device.type == "cpu"
    assert m._seq_lens_cpu.tolist() == [7, 6, 0, 0]
    assert m._num_computed_tokens_cpu.tolist() == [4, 0, 0, 0]


def test_deprecated_properties_warn_and_error_under_no_host_sync():
    _, _, _, m = two_request_batch()
    m = dataclasses.replace(m, _seq_lens_cpu=None, _num_computed_tokens_cpu=None)
    with pytest.warns(DeprecationWarning, match="seq_lens_cpu_upper_bound"):
        assert m.seq_lens_cpu.tolist() == [7, 6, 0, 0]
    with pytest.warns(DeprecationWarning):
        assert m.num_computed_tokens_cpu.tolist() == [4, 0, 0, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(HostSyncError, match="seq_lens_cpu"), no_host_sync():
            _ = m.seq_lens_cpu
        with pytest.raises(HostSyncError, match="num_computed_tokens_cpu"), no_host_sync():
            _ = m.num_computed_tokens_cpu


def test_known_exact_lengths_do_not_sync():
    _, _, _, m = two_request_batch()
    with pytest.warns(DeprecationWarning), no_host_sync():
        assert m.seq_lens_cpu.tolist() == [7, 6, 0, 0]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_reqs=3), r"query_start_loc has shape \(5,\), expected \(4,\)"),
        (dict(num_actual_tokens=8), "num_actual_tokens = 8, expected 9"),
        (dict(max_seq_len=6), "max_seq_len = 6, expected >= bound max 7"),
        (dict(max_query_len=2), "max_query_len = 2, expected >= 6"),
        (dict(seq_lens_cpu_upper_bound=torch.tensor([2, 6, 0, 0], dtype=torch.int32)),
         r"seq_lens_cpu_upper_bound\[0\] = 2 is below its query length 3"),
        (dict(seq_lens_cpu_upper_bound=torch.zeros(4, dtype=torch.int32, device="meta")),
         "must be on CPU"),
        (dict(block_table_tensor=torch.zeros(4, dtype=torch.int32)), "block_table_tensor"),
        (dict(slot_mapping=torch.zeros(3, dtype=torch.int64)), "slot_mapping has 3 entries"),
    ],
)
def test_bad_metadata_rejected(change, match):
    _, _, _, m = two_request_batch()
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(m, **change)
