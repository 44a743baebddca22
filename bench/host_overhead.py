"""Microseconds per prepare + build (CPU planning) for 1..4096 requests, and of
plan_batch alone: the host work a replayed graph step keeps (prepare's device
half and the build run inside the graph).

    python -m bench.host_overhead [--device cpu|cuda]

`plan_us` plans into a fresh pinned buffer each time; `plan_reused_us` is the runner's
path, a plan reused from a staging ring and refilled (here with events that are always
complete: the numpy work alone, without the CUDA event query).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from graphattn.backends.paged import PagedAttentionBuilder
from graphattn.batch import plan_batch, prepare_inputs
from graphattn.metadata import build_common_metadata
from graphattn.state import RequestState, SchedulerOutput
from graphattn.transfer import StagingRing

SIZES = (1, 4, 16, 64, 128, 256, 1024, 4096)


class _Done:
    def query(self) -> bool:
        return True

    def record(self, stream=None) -> None:
        pass


class _ReuseRing(StagingRing):
    """A staging ring that reuses its plans on any device (no copy is ever in flight)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.cuda = True

    def _event(self) -> _Done:
        return _Done()


def measure(num_reqs: int, device: str = "cpu", iters: int = 200) -> dict[str, float]:
    """Mean host µs of prepare_inputs and of metadata building, decode steps."""
    st = RequestState(num_reqs, 4096, 16, device)
    rng = np.random.default_rng(0)
    bpr = st.max_num_blocks_per_req
    for i in range(num_reqs):
        st.add_request(f"r{i}", int(rng.integers(16, 2048)), np.arange(i * bpr, (i + 1) * bpr))
    st.num_computed_tokens_np[:num_reqs] = st.num_prompt_tokens_np[:num_reqs]
    sched = SchedulerOutput(np.arange(num_reqs), np.ones(num_reqs, np.int32))
    builder = PagedAttentionBuilder(16)
    for _ in range(5):
        builder.build(build_common_metadata(prepare_inputs(st, sched)))
    t_prep = t_build = t_plan = t_reuse = 0.0
    ring, shape, key = _ReuseRing(), st.batch_shape(sched), (num_reqs, num_reqs)
    for _ in range(iters):
        t0 = time.perf_counter()
        batch = prepare_inputs(st, sched)
        t1 = time.perf_counter()
        builder.build(build_common_metadata(batch))
        t2 = time.perf_counter()
        plan_batch(st, sched)
        t3 = time.perf_counter()
        plan = plan_batch(st, sched, num_reqs, num_reqs, shape=shape, staging=ring)
        t4 = time.perf_counter()
        ring.release(key, plan)
        t_prep += t1 - t0
        t_build += t2 - t1
        t_plan += t3 - t2
        t_reuse += t4 - t3
    return {"num_reqs": num_reqs, "prepare_us": 1e6 * t_prep / iters,
            "build_us": 1e6 * t_build / iters, "total_us": 1e6 * (t_prep + t_build) / iters,
            "plan_us": 1e6 * t_plan / iters, "plan_reused_us": 1e6 * t_reuse / iters}


def run(device: str = "cpu", sizes: tuple[int, ...] = SIZES,
        iters: int = 200) -> list[dict[str, float]]:
    return [measure(n, device, iters=iters if n <= 1024 else max(iters // 4, 1)) for n in sizes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu",
                    help="torch device")
    args = ap.parse_args()
    print(f"{'reqs':>6} {'prepare us':>11} {'build us':>9} {'total us':>9} {'plan us':>8} "
          f"{'reused us':>9}")
    for r in run(args.device):
        print(f"{r['num_reqs']:>6} {r['prepare_us']:>11.1f} {r['build_us']:>9.1f} "
              f"{r['total_us']:>9.1f} {r['plan_us']:>8.1f} {r['plan_reused_us']:>9.1f}")


if __name__ == "__main__":
    main()
