import os

import pytest
import torch
import torch.distributed as dist

from graphattn.buckets import LengthBuckets
from graphattn.capture.data_parallel import agree_on_shape, dispatch_across_ranks
from graphattn.capture.dispatcher import GraphDispatcher
from graphattn.keys import BatchShape, GraphKey
from tests.helpers import spawn_two_ranks

SHAPES = [BatchShape(3, 6, 40, True), BatchShape(5, 10, 20, True)]
MIXED = [BatchShape(3, 6, 40, True), BatchShape(2, 9, 70, False)]


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    d = GraphDispatcher([1, 2, 4, 8], LengthBuckets(128), 2, [16, 32])
    k1, s1 = dispatch_across_ranks(d, SHAPES[rank])
    k2, _ = dispatch_across_ranks(d, MIXED[rank])
    torch.save({"k1": k1, "s1": s1, "k2": k2}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def test_two_ranks_agree_on_one_key(tmp_path):
    spawn_two_ranks(_worker, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2))
    assert r0 == r1
    assert r0["s1"] == BatchShape(5, 10, 40, True)
    assert r0["k1"] == GraphKey(8, 16, 64, True)
    assert r0["k2"] == GraphKey(16, 16, 128, False)  # one rank mixed: all take the mixed key


def test_bad_shape():
    with pytest.raises(ValueError, match=">= 0"):
        BatchShape(-1, 0, 0, True)
    assert callable(agree_on_shape)


def _runner_worker(rank, port, out_dir):
    import numpy as np

    from bench.workload import device_truth
    from graphattn import GraphRunner, RunnerConfig
    from graphattn.buckets import BucketPolicy
    from graphattn.models.tiny import TinyConfig, TinyDecoder
    from graphattn.state import RequestState, SchedulerOutput

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=1))
    st = RequestState(4, 64, 8)
    model.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(
        capture_sizes=(1, 2, 4), length_boundaries=(32,), mixed_token_sizes=(8, 16, 32))))
    runner.capture(progress=False)
    rng = np.random.default_rng(rank)
    keys, ok = [], True
    for i in range(40):
        while st.num_active < 4 and rng.random() < 0.3:
            runner.add_request(f"r{i}-{st.num_active}", rng.integers(0, 64, rng.integers(1, 12)))
        for rid, slot in list(st.req_id_to_slot.items()):
            if st.num_computed_tokens_np[slot] > 40:
                st.remove_request(rid)
        slots = np.array(sorted(st.req_id_to_slot.values()), np.int32)
        if rng.random() < 0.3:
            slots = slots[:0]  # this rank idles this step
        left = st.num_prompt_tokens_np[slots] - st.num_computed_tokens_np[slots]
        sched = SchedulerOutput(slots, np.where(left > 0, np.minimum(left, 4), 1))
        out = runner.step(sched, group=dist.group.WORLD)
        keys.append(out.key)
        ok &= bool(np.array_equal(st.num_computed_tokens_np, device_truth(st)))
    torch.save({"keys": keys, "ok": ok}, os.path.join(out_dir, f"runner{rank}.pt"))
    dist.destroy_process_group()


def test_two_runner_ranks_run_the_same_key_every_step(tmp_path):
    spawn_two_ranks(_runner_worker, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"runner{r}.pt", weights_only=False) for r in range(2))
    assert r0["keys"] == r1["keys"] and r0["ok"] and r1["ok"]
    assert sum(k is not None for k in r0["keys"]) >= 30


def test_runner_step_runs_the_given_key():
    import numpy as np

    from graphattn import GraphRunner, RunnerConfig
    from graphattn.buckets import BucketPolicy
    from graphattn.models.tiny import TinyConfig, TinyDecoder
    from graphattn.state import RequestState, SchedulerOutput

    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=1))
    st = RequestState(4, 64, 8)
    model.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(capture_sizes=(2, 4),
                                                        length_boundaries=(32,))))
    runner.capture(progress=False)
    a = runner.add_request("a", [1, 2, 3])
    runner.step(SchedulerOutput(np.array([a]), np.array([3])))
    agreed = GraphKey(4, 4, 32, True)  # another rank had 4 rows
    out = runner.step(SchedulerOutput(np.array([a]), np.array([1])), key=agreed)
    assert out.key == agreed and out.replayed and out.sampled.shape == (1,)
    idle = runner.step(SchedulerOutput(np.array([], np.int32), np.array([], np.int32)),
                       key=agreed)  # an idle rank: a dummy run of the agreed key
    assert idle.replayed and idle.sampled.shape == (0,)
    with pytest.raises(ValueError, match=r"does not fit the key .* max length 5 exceeds"):
        runner.step(SchedulerOutput(np.array([a]), np.array([1])), key=GraphKey(4, 4, 4, True))
