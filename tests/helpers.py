"""Shared test fixtures: a small hand-made batch."""

import numpy as np

from graphattn.batch import prepare_inputs
from graphattn.metadata import build_common_metadata
from graphattn.state import RequestState, SchedulerOutput


def two_request_state(device="cpu"):
    """Request a: prompt 6, blocks [5, 9]; request b: 4 cached of 7, blocks [2, 3]."""
    st = RequestState(max_num_reqs=4, max_model_len=32, block_size=4, device=device)
    st.add_request("a", 6, [5, 9])
    st.add_request("b", 7, [2, 3], num_computed_tokens=4)
    return st


def two_request_batch(device="cpu", reqs_padded=4, toks_padded=12):
    st = two_request_state(device)
    sched = SchedulerOutput(np.array([1, 0]), np.array([3, 6]))
    batch = prepare_inputs(st, sched, reqs_padded, toks_padded)
    return st, sched, batch, build_common_metadata(batch)


def spawn_two_ranks(worker, out_dir, tries: int = 3) -> None:
    """Run ``worker(rank, port, out_dir)`` in 2 processes (gloo rendezvous on a free port).

    A rendezvous can lose its port to another process between the probe and the bind, so a
    failed run is retried on a fresh port; a real failure fails every try.
    """
    import socket

    import torch.multiprocessing as mp

    for attempt in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            mp.spawn(worker, args=(port, str(out_dir)), nprocs=2, join=True)
            return
        except mp.ProcessRaisedException:
            if attempt == tries - 1:
                raise
