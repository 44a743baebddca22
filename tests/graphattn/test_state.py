import numpy as np
import pytest
import torch

from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import no_host_sync


def make_state(**kw):
    args = dict(max_num_reqs=4, max_model_len=64, block_size=4)
    args.update(kw)
    return RequestState(**args)


def test_add_remove_and_slots():
    st = make_state()
    a = st.add_request("a", 10, [3, 4, 5])
    b = st.add_request("b", 5, [7, 8], num_computed_tokens=2)
    assert (a, b) == (0, 1)
    assert st.num_computed_tokens_np[:2].tolist() == [0, 2]
    assert st.block_table_np[0, :4].tolist() == [3, 4, 5, 64]  # then the sink (64 blocks)
    assert st.block_table[1, :2].tolist() == [7, 8]
    assert st.num_computed_tokens[:2].tolist() == [0, 2]
    assert st.slots_of(["b", "a"]).tolist() == [1, 0]
    assert st.remove_request("a") == 0
    assert st.add_request("c", 3, [1]) == 0  # slot reused
    assert st.num_active == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_prompt_tokens=0, block_ids=[1]), r"num_prompt_tokens = 0, expected in \[1, 64\]"),
        (dict(num_prompt_tokens=65, block_ids=[1]), "65"),
        (dict(num_prompt_tokens=4, block_ids=[1], num_computed_tokens=4),
         r"num_computed_tokens = 4, expected in \[0, 3\]"),
        (dict(num_prompt_tokens=4, block_ids=list(range(17))),
         r"0 \+ 17 block ids, expected at most 16"),
        (dict(num_prompt_tokens=4, block_ids=[0.5]), "integers"),
    ],
)
def test_add_request_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_state().add_request("x", **kwargs)


def test_duplicate_full_unknown():
    st = make_state(max_num_reqs=1)
    st.add_request("a", 3, [0])
    with pytest.raises(ValueError, match="already in slot 0"):
        st.add_request("a", 3, [0])
    with pytest.raises(ValueError, match="no free slot: all 1"):
        st.add_request("b", 3, [1])
    with pytest.raises(ValueError, match="unknown request 'zz'"):
        st.remove_request("zz")
    with pytest.raises(ValueError, match="unknown requests"):
        st.slots_of(["zz"])


def test_scheduler_output_validation():
    with pytest.raises(ValueError, match="num_scheduled_tokens has 1 entries, expected 2"):
        SchedulerOutput(np.array([0, 1]), np.array([1]))
    with pytest.raises(ValueError, match=r"num_scheduled_tokens\[1\] = -2, expected >= 1"):
        SchedulerOutput(np.array([0, 1]), np.array([1, -2]))
    with pytest.raises(ValueError, match="unique"):
        SchedulerOutput(np.array([1, 1]), np.array([1, 1]))
    with pytest.raises(ValueError, match=r"num_draft_tokens\[0\] = 2, expected in \[0, 1\]"):
        SchedulerOutput(np.array([0]), np.array([2]), np.array([2]))
    with pytest.raises(ValueError, match="1-D"):
        SchedulerOutput(np.zeros((1, 1), int), np.array([1]))
    empty = SchedulerOutput(np.array([], np.int32), np.array([], np.int32))
    assert empty.num_reqs == 0 and empty.total_num_scheduled_tokens == 0


def test_check_schedule():
    st = make_state()
    st.add_request("a", 60, range(15))
    with pytest.raises(ValueError, match=r"req_slots \[1\] hold no request"):
        st.check_schedule(SchedulerOutput(np.array([1]), np.array([1])))
    with pytest.raises(ValueError, match=r"req_slots must be in \[0, 4\)"):
        st.check_schedule(SchedulerOutput(np.array([9]), np.array([1])))
    with pytest.raises(ValueError, match="65 exceeds max_model_len 64"):
        st.check_schedule(SchedulerOutput(np.array([0]), np.array([65])))


def test_capacity_follows_blocks_and_slots():
    st = make_state()
    a = st.add_request("a", 10, [0, 1, 2])  # 3 blocks of 4 tokens
    assert st.capacity_np[a] == 12 and st.capacity_np[1] == -1  # a free slot: -1
    st.append_blocks("a", range(3, 16))  # 16 blocks hold 64 = max_model_len
    assert st.capacity_np[a] == 64
    st.remove_request("a")
    assert st.capacity_np[a] == -1


def test_postprocess_advances_mirror_and_device():
    st = make_state()
    st.add_request("a", 10, [0, 1, 2])
    st.add_request("b", 3, [4])
    sched = SchedulerOutput(np.array([1, 0]), np.array([3, 8]), None)
    st.postprocess(sched)
    assert st.num_computed_tokens_np[:2].tolist() == [8, 3]
    assert st.num_computed_tokens[:2].tolist() == [8, 3]
    # drafts: mirror optimistic, device exact
    spec = SchedulerOutput(np.array([1]), np.array([3]), np.array([2]))
    st.postprocess(spec, num_rejected=torch.tensor([2], dtype=torch.int32))
    assert st.num_computed_tokens_np[1] == 6
    assert st.num_computed_tokens[1].item() == 4
    assert st.num_pending_drafts_np[1] == 2


def test_mirror_and_device_halves_and_padded_device_rows():
    st = make_state()
    st.add_request("a", 10, [0, 1, 2])
    st.add_request("b", 3, [4])
    sched = SchedulerOutput(np.array([1, 0]), np.array([3, 8]), np.array([2, 0]))
    st.advance_mirror(sched)
    assert st.num_computed_tokens_np[:2].tolist() == [8, 3]
    assert st.num_pending_drafts_np[:2].tolist() == [0, 2]
    assert st.num_computed_tokens[:2].tolist() == [0, 0]  # the device is untouched
    # padded rows (slot 0, 0 scheduled) add nothing; with no_host_sync: no host read
    with no_host_sync():
        st.advance_device(torch.tensor([1, 0, 0, 0]), torch.tensor([3, 8, 0, 0], dtype=torch.int32),
                          torch.tensor([1, 0, 0, 0], dtype=torch.int32))
    assert st.num_computed_tokens[:2].tolist() == [8, 2]
    # postprocess takes an InputBatch's padded device rows and uses the first num_reqs
    st.postprocess(SchedulerOutput(np.array([0]), np.array([1])),
                   req_slots=torch.tensor([0, 0, 0]), num_scheduled=torch.tensor([1, 0, 0]))
    assert st.num_computed_tokens[:2].tolist() == [9, 2]


def test_postprocess_pool_reports_finished_prompts():
    st = make_state()
    st.add_request("a", 5, [0, 1])
    st.add_request("b", 3, [2])
    done = st.postprocess_pool(SchedulerOutput(np.array([0, 1]), np.array([4, 3])))
    assert done.tolist() == [False, True]
    with pytest.raises(ValueError, match="pooling models take no draft tokens"):
        st.postprocess_pool(SchedulerOutput(np.array([0]), np.array([2]), np.array([1])))


def test_meta_device_state():
    st = make_state(device="meta")
    st.add_request("a", 5, [0, 1])
    st.postprocess(SchedulerOutput(np.array([0]), np.array([5])))
    assert st.num_computed_tokens.device.type == "meta"
    assert st.num_computed_tokens_np[0] == 5
