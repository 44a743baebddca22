"""Serving-loop features of the runner: on-device sampling with per-request parameters,
tokens to the host through TokenFuture."""

import numpy as np
import pytest
import torch

from graphattn.buckets import BucketPolicy
from graphattn.capture.runner import GraphRunner, SamplingParams
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import no_host_sync


def make(sampling=True, device="cpu"):
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32)).to(device)
    st = RequestState(4, 64, 8, device)
    model.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    runner = GraphRunner(model, st, policy=BucketPolicy(capture_sizes=(2, 4),
                                                        length_boundaries=(32,)),
                         sampling=sampling)
    return st, runner


def generate(runner, st, params, steps, force_eager=False):
    slots = np.array([runner.add_request(f"r{i}", [1 + i, 2, 3], sampling=p)
                      for i, p in enumerate(params)], np.int32)
    runner.step(SchedulerOutput(slots, np.full(len(slots), 3)), force_eager=force_eager)
    out, logprobs = [], []
    for _ in range(steps):
        with no_host_sync():
            o = runner.step(SchedulerOutput(slots, np.ones(len(slots), np.int32)),
                            force_eager=force_eager)
        out.append(o.sampled_host.wait())
        logprobs.append(o.logprobs.clone())
        assert o.sampled_host.wait().dtype == np.int64
        assert torch.equal(torch.from_numpy(o.sampled_host.wait()), o.sampled)
    return np.stack(out), torch.stack(logprobs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_seeded_requests_draw_the_same_tokens_on_replay_and_eager(device):
    params = [SamplingParams(), SamplingParams(temperature=1.5, top_k=20, seed=7),
              SamplingParams(temperature=0.9, top_p=0.9, seed=11)]
    st, runner = make(device=device)
    runner.capture(progress=False)
    replayed, lp = generate(runner, st, params, 12)
    st2, eager = make(device=device)
    eager_tokens, _ = generate(eager, st2, params, 12, force_eager=True)
    np.testing.assert_array_equal(replayed, eager_tokens)
    assert len(set(replayed[:, 1].tolist())) > 2  # it does sample
    assert (lp <= 0).all()


def test_greedy_runner_refuses_sampling_params():
    st, runner = make(sampling=False)
    with pytest.raises(ValueError, match=r"samples greedily: build it with GraphRunner\(\.\.\., "
                                         r"sampling=True\)"):
        runner.add_request("a", [1, 2], sampling=SamplingParams(temperature=1.0))
    assert st.num_active == 0
    slot = runner.add_request("a", [1, 2])
    out = runner.step(SchedulerOutput(np.array([slot]), np.array([2])))
    assert out.logprobs is None and out.sampled_host.wait().tolist() == out.sampled.tolist()
