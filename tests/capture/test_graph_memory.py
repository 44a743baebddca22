"""The graph pool's size before capture, and the capture sizes that fit a budget."""

import pytest
import torch

from graphattn import GraphKey, GraphRunner, RunnerConfig
from graphattn.buckets import BucketPolicy
from graphattn.capture.graph_memory import SEGMENT, GraphMemoryEstimate, fit_capture_sizes
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState


def make(device="cpu", sizes=(1, 2, 4, 8), mixed=(16, 32), vocab=512, hidden=64):
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=vocab, hidden_size=hidden,
                                   intermediate_size=4 * hidden)).to(device)
    st = RequestState(8, 64, 8, device)
    model.allocate_caches(8 * st.max_num_blocks_per_req, 8)
    policy = BucketPolicy(capture_sizes=sizes, length_boundaries=(64,),
                          mixed_token_sizes=mixed)
    return st, GraphRunner(model, st, RunnerConfig(policy=policy))


def test_estimate_counts_each_keys_kept_outputs_largest_first():
    st, runner = make()
    est = runner.estimate_graph_memory()
    assert list(est.keys) == runner.dispatcher.all_keys()
    assert st.num_steps == 0 and not runner.graphs.keys  # dry runs change nothing
    for key, out in zip(est.keys, est.kept_bytes, strict=True):
        rows = min(key.num_reqs_padded, st.max_num_reqs)
        # the sampled tokens stay; the logits (scratch outputs, float32 [rows, 512]) are
        # not kept by the key's graph
        assert rows * 8 <= out < rows * 512 * 4


def test_fit_drops_the_largest_sizes_first():
    keys = tuple(GraphKey(r, r, 64, True) for r in (8, 4, 2, 1)) + (GraphKey(32, 32, 64, False),)
    mib = 1 << 20
    est = GraphMemoryEstimate(keys, (9 * mib, 5 * mib, 3 * mib, 2 * mib, 30 * mib),
                              (mib, mib, mib, mib, 2 * mib))
    assert est.total_bytes == 28 * mib + 6 * mib
    policy = BucketPolicy(capture_sizes=(1, 2, 4, 8), mixed_token_sizes=(32,))
    fitted = fit_capture_sizes(policy, est, 12 * mib)  # the mixed key (32 tokens) goes first
    assert fitted.mixed_token_sizes == () and fitted.capture_sizes == (1, 2, 4, 8)
    fitted = fit_capture_sizes(policy, est, 6 * mib)  # then 8 (8 - 1 + 4 > 6), then 4
    assert fitted.capture_sizes == (1, 2)
    with pytest.raises(ValueError, match="smallest capture size 1 alone"):
        fit_capture_sizes(policy, est, SEGMENT // 2)


def test_runner_takes_the_fitted_policy_before_capture():
    st, runner = make()
    est = runner.estimate_graph_memory()
    # kept outputs of MiBs per key (off CUDA there is no graph pool, and the logits are
    # not kept), so the 2 MiB rounding does not hide them
    est = GraphMemoryEstimate(est.keys, est.alone_bytes,
                              tuple(k.num_tokens_padded << 20 for k in est.keys))
    runner.estimate_graph_memory = lambda keys=None: est
    budget = est.without({k for k in est.keys if k.num_tokens_padded > 4}).total_bytes
    assert budget < est.total_bytes
    policy = runner.fit_capture_sizes(budget)
    assert runner.config.policy == policy
    kept = set(runner.dispatcher.all_keys())
    assert kept < set(est.keys) and policy.mixed_token_sizes == ()
    assert est.without(set(est.keys) - kept).total_bytes <= budget
    runner.capture(progress=False)
    with pytest.raises(ValueError, match="comes before capture"):
        runner.fit_capture_sizes(budget)


@pytest.mark.cuda
def test_estimate_is_within_ten_percent_of_the_captured_pool():
    """The tiny model at a width and token counts whose pool spans several segments."""
    st, runner = make("cuda", mixed=(256, 512), vocab=32768, hidden=1024)
    est = runner.estimate_graph_memory()  # dry-run captures, released
    assert not runner.graphs.keys and all(a > k for a, k in zip(est.alone_bytes,
                                                                  est.kept_bytes, strict=True))
    report = runner.capture(progress=False)
    assert report.pool_bytes > 0
    assert abs(est.total_bytes - report.pool_bytes) <= 0.1 * report.pool_bytes, (
        est.total_bytes, report.pool_bytes)
