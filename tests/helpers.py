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

    A rendezvous can lose its port to another process between the probe and the bind, and
    gloo can abort a rank (SIGABRT from its C++ layer) when a connection drops, so a failed
    run (an exception or a killed rank) is retried on a fresh port; a real failure fails
    every try.
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
        except (mp.ProcessRaisedException, mp.ProcessExitedException):  # raised, or killed
            if attempt == tries - 1:
                raise


def serve_greedy(runner, prompts, new, chunk, on_token=None):
    """Admit `prompts`, prefill them `chunk` tokens a step and decode until each has `new`
    greedy tokens, every step under no_host_sync(); returns each request's tokens.
    ``on_token(j, out, k)`` sees row j's k-th token's step before it is recorded."""
    from graphattn import SchedulerOutput
    from graphattn.sync import no_host_sync

    st = runner.state
    slots = np.array([runner.add_request(f"r{i}", p) for i, p in enumerate(prompts)], np.int32)
    got = [[] for _ in prompts]
    while min(len(g) for g in got) < new:
        left = st.num_prompt_tokens_np[slots] - st.num_computed_tokens_np[slots]
        with no_host_sync():
            out = runner.step(SchedulerOutput(slots, np.where(left > 0, np.minimum(left, chunk),
                                                              1)))
        for j, s in enumerate(slots):
            if st.num_computed_tokens_np[s] >= len(prompts[j]) and len(got[j]) < new:
                if on_token is not None:
                    on_token(j, out, len(got[j]))
                got[j].append(int(out.sampled[j]))
    return got
