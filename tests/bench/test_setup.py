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
    meta = result_meta("bench.startup", args)
    assert meta["command"] == "python -m bench.startup --models tiny --lazy"
    assert set(meta) == {"date", "torch", "triton", "device", "command"}

