"""The benchmarks' shared set-up: runner options reach `RunnerConfig`, the rest `GraphRunner`."""

from bench.setup import make_setup
from graphattn import BucketPolicy
from graphattn.keys import CUDAGraphMode


def test_make_setup_routes_compile_and_graph_mode_into_the_runner_config():
    policy = BucketPolicy(capture_sizes=(2,), length_boundaries=(256,),
                          piecewise_token_sizes=(8,))
    setup = make_setup("cpu", 2, 256, policy, compile=True, mode=CUDAGraphMode.PIECEWISE)
    assert setup.runner.config.compile.enabled
    assert setup.runner.config.cudagraph_mode is CUDAGraphMode.PIECEWISE
    assert setup.runner.config.policy is policy
    assert not make_setup("cpu", 2, 256, policy).runner.config.compile.enabled


def test_result_meta_writes_a_command_that_runs():
    import argparse

    from bench.setup import result_meta

    args = argparse.Namespace(models="tiny", lazy=True, verbose=False, sizes=None, out="x")
    assert result_meta("bench.startup", args)["command"] == (
        "python -m bench.startup --models tiny --lazy")


def test_hf_llama_of_a_bench_shape_serves_graph_replay_steps():
    """`bench.graph_replay`'s transformers modes: the Llama of the setup's shape on its state."""
    import numpy as np
    import pytest

    pytest.importorskip("transformers")
    from bench.graph_replay import _mode_runner, replay_policy
    from bench.setup import fill_requests
    from graphattn.models.tiny import TinyConfig
    from graphattn.state import SchedulerOutput

    cfg = TinyConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=128)
    policy, max_len = replay_policy((1, 4), (32,), 2)
    setup = make_setup("cpu", 4, max_len, policy, cfg)
    fill_requests(setup, 4, np.full(4, 16, np.int32), np.random.default_rng(0))
    runner = _mode_runner("hf_graphs", setup, policy)
    assert type(runner.forward).__name__ == "HFCausalLM" and not setup.model.caches
    runner.capture(progress=False)
    out = runner.step(SchedulerOutput(np.arange(4, dtype=np.int32), np.ones(4, np.int32)))
    assert out.replayed and out.key.num_reqs_padded == 4
