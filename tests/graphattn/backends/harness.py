"""Random workloads with a float64 dense reference for the attention backends."""

from __future__ import annotations

import numpy as np
import torch

from bench.workload import SyntheticScheduler, WorkloadConfig
from graphattn.batch import prepare_inputs
from graphattn.metadata import build_common_metadata
from graphattn.state import RequestState


def dense_attention(q, k, v, scale, window=0, softcap=0.0, sinks=None):
    """float64 reference: q [H, D] at the last position over k [L, Hkv, D], v [L, Hkv, Dv].

    window: only the last `window` keys; softcap: cap * tanh(s / cap); sinks [H]: an
    extra logit per head in the softmax that carries no value. Returns [H, Dv].
    """
    h, hkv = q.shape[0], k.shape[1]
    if window > 0:
        k, v = k[-window:], v[-window:]
    if k.shape[0] == 0:
        return torch.zeros(h, v.shape[-1], dtype=torch.float64)
    kk = k.repeat_interleave(h // hkv, dim=1)
    vv = v.repeat_interleave(h // hkv, dim=1)
    s = torch.einsum("hd,lhd->hl", q.double(), kk.double()) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if sinks is not None:
        s = torch.cat([s, sinks.double().cpu()[:, None]], 1)
        return torch.einsum("hl,lhd->hd", s.softmax(-1)[:, :-1], vv.double())
    return torch.einsum("hl,lhd->hd", s.softmax(-1), vv.double())


class Scenario:
    """Steps of a random workload; `logical[slot]` mirrors what the cache holds."""

    def __init__(self, cfg: WorkloadConfig, seed: int, max_num_reqs: int = 5,
                 max_model_len: int = 128, block_size: int = 8, device: str = "cpu") -> None:
        self.state = RequestState(max_num_reqs, max_model_len, block_size, device)
        self.sched = SyntheticScheduler(self.state, cfg, seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.device = device
        self.logical: dict[int, torch.Tensor] = {}

    @property
    def num_blocks(self) -> int:
        return self.sched.num_blocks - 1

    def rand(self, *shape):
        return (torch.rand(*shape, generator=self.gen, dtype=torch.float64) * 2 - 1)

    def next_batch(self, pad_reqs: int = 0, pad_tokens: int = 0):
        s = self.sched.next_schedule()
        batch = prepare_inputs(self.state, s, s.num_reqs + pad_reqs,
                               s.total_num_scheduled_tokens + pad_tokens)
        return s, batch, build_common_metadata(batch)

    def record(self, s, batch, values: torch.Tensor) -> None:
        """values [T_real, ...] were written at the batch's positions."""
        pos = batch.positions[: s.total_num_scheduled_tokens].cpu()
        rows = torch.from_numpy(batch.req_indices_np[: s.total_num_scheduled_tokens]).long()
        for r in range(s.num_reqs):
            slot = int(s.req_slots[r])
            store = self.logical.setdefault(
                slot, torch.zeros(self.state.max_model_len, *values.shape[1:], dtype=torch.float64))
            sel = rows == r
            store[pos[sel]] = values[sel].double().cpu()

    def reset_finished(self) -> None:
        for slot in list(self.logical):
            if not self.state.active_np[slot]:
                del self.logical[slot]

    def token_views(self, s, batch):
        """(row, slot, position) of each real token."""
        n = s.total_num_scheduled_tokens
        rows = batch.req_indices_np[:n]
        return rows, s.req_slots[rows], batch.positions[:n].cpu().numpy()

    def finish(self, s) -> None:
        self.sched.finish_step(s)
        self.reset_finished()
