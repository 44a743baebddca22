import numpy as np
import pytest
import torch

from graphattn.batch import prepare_inputs
from graphattn.spec_decode import RejectionFeedback, apply_rejections, verify_schedule
from graphattn.state import RequestState, SchedulerOutput


def decoding_state():
    st = RequestState(4, 64, 4)
    st.add_request("a", 5, np.arange(16))
    st.postprocess(SchedulerOutput(np.array([0]), np.array([5])))
    return st


def test_bound_minus_rejected_on_cpu():
    st = decoding_state()
    sched = verify_schedule(st, np.array([0]), np.array([3]))
    assert sched.num_scheduled_tokens.tolist() == [4]
    b = prepare_inputs(st, sched)
    assert b.seq_lens_cpu_upper_bound_np.tolist() == [9]
    st.postprocess(sched, num_rejected=torch.tensor([2], dtype=torch.int32))
    assert st.num_computed_tokens_np[0] == 9  # optimistic
    assert st.num_computed_tokens[0].item() == 7  # truth
    # next step before the feedback arrives: bound over-estimates, positions exact
    nxt = verify_schedule(st, np.array([0]), np.array([1]))
    b = prepare_inputs(st, nxt)
    assert b.seq_lens_cpu_upper_bound_np.tolist() == [11] and b.seq_lens.tolist() == [9]
    assert b.positions.tolist() == [7, 8] and not b.seq_lens_exact
    apply_rejections(st, RejectionFeedback(np.array([0]), np.array([3]), np.array([2])))
    assert st.num_computed_tokens_np[0] == 7 and st.num_pending_drafts_np[0] == 0
    assert prepare_inputs(st, nxt).seq_lens_exact


def test_feedback_validation():
    st = decoding_state()
    with pytest.raises(ValueError, match=r"num_rejected_tokens\[0\] = 4, expected in \[0, "
                                         r"num_draft_tokens=3\]"):
        RejectionFeedback(np.array([0]), np.array([3]), np.array([4]))
    with pytest.raises(ValueError, match="num_draft_tokens has 2 entries, expected 1"):
        RejectionFeedback(np.array([0]), np.array([3, 1]), np.array([0]))
    fb = RejectionFeedback(np.array([0]), np.array([3]), np.array([1]))
    with pytest.raises(ValueError, match="feedback for 3 drafts, but only 0 await"):
        apply_rejections(st, fb)
    with pytest.raises(ValueError, match=r"req_slots \[2\] hold no request"):
        apply_rejections(st, RejectionFeedback(np.array([2]), np.array([0]), np.array([0])))
    with pytest.raises(ValueError, match=r"num_draft_tokens\[0\] = -1, expected in \[0, 65536\]"):
        verify_schedule(st, np.array([0]), np.array([-1]))
    apply_rejections(st, RejectionFeedback(np.array([], int), np.array([], int), np.array([], int)))
