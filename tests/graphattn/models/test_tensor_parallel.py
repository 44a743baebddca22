"""Tensor parallel TinyDecoder on 2 gloo processes: each rank holds half of the heads, KV
heads and MLP, all-reduces after o and down, and the runner's logits equal one process's."""

import dataclasses
import os

import numpy as np
import torch
import torch.distributed as dist

from graphattn import GraphRunner, RunnerConfig
from graphattn.buckets import BucketPolicy
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState, SchedulerOutput
from tests.helpers import spawn_two_ranks

CFG = TinyConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                 intermediate_size=96)


def _runner(model):
    st = RequestState(3, 64, 8)
    model.allocate_caches(3 * st.max_num_blocks_per_req, 8)
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(capture_sizes=(2, 4),
                                                        length_boundaries=(32,),
                                                        mixed_token_sizes=(16,))))
    runner.capture(progress=False)
    return runner


def _worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    full = TinyDecoder(CFG).double()
    shard = TinyDecoder(dataclasses.replace(CFG, tp_size=2), tp_group=dist.group.WORLD)
    shard = shard.double().load_shard(full, rank)
    one, tp = _runner(full), _runner(shard)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    for p in prompts:
        one.add_request(str(p), p)
        tp.add_request(str(p), p)
    slots = np.array([0, 1], np.int32)
    diffs = []
    for sched in [SchedulerOutput(slots, np.array([5, 3]))] + [
            SchedulerOutput(slots, np.ones(2, np.int32))] * 6:
        a, b = one.step(sched), tp.step(sched)
        diffs.append(float((a.logits - b.logits).abs().max()))
        assert a.key == b.key
    torch.save({"diffs": diffs}, os.path.join(out_dir, f"tp{rank}.pt"))
    dist.destroy_process_group()


def test_tp2_logits_equal_one_process(tmp_path):
    spawn_two_ranks(_worker, tmp_path)
    for r in range(2):
        got = torch.load(tmp_path / f"tp{r}.pt", weights_only=False)
        assert max(got["diffs"]) < 1e-10, got["diffs"]


def test_tp_config_is_validated():
    import pytest

    with pytest.raises(ValueError, match="tp_size = 3 must divide num_kv_heads 4"):
        dataclasses.replace(CFG, tp_size=3)
