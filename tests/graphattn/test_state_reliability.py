"""Bad input to the state layer is refused with a clear error before anything changes
(each case reproduces a defect found by an adversarial run)."""

import copy

import numpy as np
import pytest
import torch

from graphattn.spec_decode import RejectionFeedback, apply_rejections
from graphattn.state import RequestState, SchedulerOutput


def snapshot(st):
    return copy.deepcopy({k: v for k, v in vars(st).items() if k != "device"})


def same(a, b):
    for k in a:
        x, y = a[k], b[k]
        if k == "holders":
            x, y = (np.concatenate([h.count, h.write_floor]) for h in (x, y))
        if isinstance(x, np.ndarray | torch.Tensor):
            assert (x == y).all(), k
        else:
            assert x == y, k


def test_block_ids_checked_owned_once_and_sink_past_them():
    st = RequestState(4, 64, 4, num_kv_blocks=40)
    st.add_request("a", 10, [5, 6, 7])
    before = snapshot(st)
    with pytest.raises(ValueError, match=r"request 'b': 2 blocks of 4 tokens for a prompt of 9 "
                                         r"tokens, expected at least 3 blocks"):
        st.add_request("b", 9, [1, 2])
    with pytest.raises(ValueError, match=r"request 'b': blocks \[6\] are held by another live "
                                         r"request; a request shares only full blocks below "
                                         r"its num_computed_tokens \(0\)"):
        st.add_request("b", 5, [6, 8])
    with pytest.raises(ValueError, match=r"request 'b': block 6 is not read-only for another "
                                         r"live request yet"):
        st.add_request("b", 9, [6, 8, 9], num_computed_tokens=8)  # a has computed nothing
    with pytest.raises(ValueError, match=r"block_ids of request 'b'\[0\] = -1, expected in "
                                         r"\[0, 39\]"):
        st.add_request("b", 3, [-1])
    with pytest.raises(ValueError, match=r"\[1\] = 40, expected in \[0, 39\]"):
        st.add_request("b", 3, [1, 40])
    with pytest.raises(ValueError, match="block ids repeat"):
        st.add_request("b", 3, [1, 1])
    same(before, snapshot(st))
    assert st.block_table_np[0].tolist()[:4] == [5, 6, 7, 40]  # 40: the sink
    # a request outgrowing its blocks is refused at schedule time, naming it
    st.num_computed_tokens_np[0] = 10
    with pytest.raises(ValueError, match=r"request 'a' \(slot 0\): 13 tokens after this step, "
                                         r"but its 3 blocks hold 12; append_blocks first"):
        st.batch_shape(SchedulerOutput(np.array([0]), np.array([3])))
    st.append_blocks("a", [9])
    assert st.batch_shape(SchedulerOutput(np.array([0]), np.array([3]))).max_seq_len == 13
    assert st.block_table[0, :5].tolist() == [5, 6, 7, 9, 40]
    with pytest.raises(ValueError, match=r"block ids repeat \(or are its own already\)"):
        st.append_blocks("a", [9])
    st.remove_request("a")
    st.add_request("b", 5, [6, 7])  # a finished request's blocks are free again


def test_scheduler_output_copies_and_range_checks():
    slots = np.array([0, 1], np.int64)
    sched = SchedulerOutput(slots, np.array([1, 1]))
    slots[1] = 0  # the caller edits its array after validation
    assert sched.req_slots.tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"num_scheduled_tokens\[0\] = 4294967296, expected >= 1"):
        SchedulerOutput(np.array([0]), np.array([2**32]))
    with pytest.raises(ValueError, match=r"req_slots\[0\] = 4294967296"):
        SchedulerOutput(np.array([2**32]), np.array([1]))


@pytest.mark.parametrize("args, match", [
    ((4, 2**31, 8), r"max_model_len = 2147483648, expected in \[1, 1073741823\]"),
    ((4, 64.5, 8), r"max_model_len must be an integer, got 64.5"),
    ((4.0, 64, 8), r"max_num_reqs must be an integer, got 4.0"),
    ((4, 64, 0), r"block_size = 0, expected in \[1, 64\]"),
])
def test_constructor_refuses_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        RequestState(*args)


def test_add_request_validates_everything_first():
    st = RequestState(2, 64, 4)
    st.add_request("a", 3, [0])
    before = snapshot(st)
    for kwargs, match in [
        (dict(num_prompt_tokens=5.5, block_ids=[2, 3]), "num_prompt_tokens must be an integer"),
        (dict(num_prompt_tokens=2**40, block_ids=[2]), r"num_prompt_tokens = 1099511627776"),
        (dict(num_prompt_tokens=3, block_ids=np.zeros((1, 1), int)), "must be 1-D"),
        (dict(num_prompt_tokens=3, block_ids=[2**40]), r"= 1099511627776, expected in"),
    ]:
        with pytest.raises(ValueError, match=match):
            st.add_request("b", **kwargs)
        same(before, snapshot(st))
    with pytest.raises(ValueError, match="req_id must be a str"):
        st.add_request(7, 3, [2])


def make_spec_state():
    st = RequestState(3, 64, 4)
    st.add_request("a", 2, range(0, 16))
    st.add_request("b", 2, range(16, 32))
    return st


def verify_step(st, slots, drafts):
    sched = SchedulerOutput(np.array(slots), np.array(drafts) + 1, np.array(drafts))
    st.advance_mirror(sched)
    return sched


def test_feedback_duplicates_and_stale_rows_refused_row_by_row():
    st = make_spec_state()
    s1 = verify_step(st, [0, 1], [3, 3])
    fb1 = RejectionFeedback.of_step(st, s1, np.array([1, 2]))
    s2 = verify_step(st, [0, 1], [3, 3])
    fb2 = RejectionFeedback.of_step(st, s2, np.array([0, 3]))
    assert st.num_computed_tokens_np[:2].tolist() == [8, 8]
    res = apply_rejections(st, fb1)
    assert res.applied.tolist() == [True, True]
    assert st.num_computed_tokens_np[:2].tolist() == [7, 6]
    # applied twice while step 2's feedback is pending: refused (was silently applied)
    again = apply_rejections(st, fb1)
    assert again.duplicate.tolist() == [True, True] and not again.applied.any()
    assert st.num_computed_tokens_np[:2].tolist() == [7, 6]
    # request b finishes; c takes its slot; b's late feedback must not land on c
    st.remove_request("b")
    c = st.add_request("c", 5, range(16, 18))
    assert c == 1
    res = apply_rejections(st, fb2)
    assert res.applied.tolist() == [True, False] and res.stale.tolist() == [False, True]
    assert st.num_computed_tokens_np[:2].tolist() == [7, 0]
    assert st.num_pending_drafts_np[:2].tolist() == [0, 0]  # a's bound is exact again


def test_feedback_applies_in_any_order_each_once():
    """Step 2's feedback before step 1's: both apply (step 1 was refused as a duplicate)."""
    st = make_spec_state()
    s1 = verify_step(st, [0, 1], [3, 3])
    fb1 = RejectionFeedback.of_step(st, s1, np.array([1, 2]))
    s2 = verify_step(st, [0, 1], [3, 3])
    fb2 = RejectionFeedback.of_step(st, s2, np.array([0, 3]))
    assert apply_rejections(st, fb2).applied.all()
    assert apply_rejections(st, fb1).applied.all()
    assert st.num_computed_tokens_np[:2].tolist() == [7, 3]
    assert st.num_pending_drafts_np[:2].tolist() == [0, 0] and not st.awaiting_feedback
    for fb in (fb1, fb2):
        assert apply_rejections(st, fb).duplicate.all()
    assert st.num_computed_tokens_np[:2].tolist() == [7, 3]


def test_feedback_of_another_state_is_refused():
    """Generations and state ids are unique in the process: two states' counters never
    meet, and feedback says which state it came from."""
    a, b = make_spec_state(), make_spec_state()
    assert not set(a.generation_np[:2]) & set(b.generation_np[:2]) and a.uid != b.uid
    fb = RejectionFeedback.of_step(a, verify_step(a, [0, 1], [3, 3]), np.array([1, 2]))
    verify_step(b, [0, 1], [3, 3])
    with pytest.raises(ValueError, match=f"feedback of the state with uid {a.uid}, applied "
                                         f"to the state with uid {b.uid}"):
        apply_rejections(b, fb)
    assert b.num_computed_tokens_np[:2].tolist() == [4, 4]
    unsigned = RejectionFeedback(fb.req_slots, fb.num_draft_tokens, fb.num_rejected_tokens,
                                 fb.generations, fb.step)
    assert apply_rejections(b, unsigned).stale.all()  # other generations: stale
    assert b.num_computed_tokens_np[:2].tolist() == [4, 4]


def test_resync_restores_mirror_from_device():
    st = RequestState(2, 64, 4)
    st.add_request("a", 8, [0, 1])
    st.num_computed_tokens_np[0] = 5  # as if a step's mirror advance was lost
    st.num_computed_tokens[0:1].fill_(7)
    st.resync()
    assert st.num_computed_tokens_np[0] == 7
