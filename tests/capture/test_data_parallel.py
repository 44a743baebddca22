import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphattn.buckets import LengthBuckets
from graphattn.capture.data_parallel import BatchShape, agree_on_shape, dispatch_across_ranks
from graphattn.capture.dispatcher import GraphDispatcher, GraphKey

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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_agree_on_one_key(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(2))
    assert r0 == r1
    assert r0["s1"] == BatchShape(5, 10, 40, True)
    assert r0["k1"] == GraphKey(8, 16, 64, True)
    assert r0["k2"] == GraphKey(16, 16, 128, False)  # one rank mixed: all take the mixed key


def test_bad_shape():
    with pytest.raises(ValueError, match=">= 0"):
        BatchShape(-1, 0, 0, True)
    assert callable(agree_on_shape)
