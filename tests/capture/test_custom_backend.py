"""An out-of-tree backend: this file plus one register_backend call, run through the runner
and capture like a built-in one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from graphattn import GraphRunner, RunnerConfig
from graphattn.backends import BackendMetadata, BackendSpec, BuilderContext, register_backend
from graphattn.backends.reference import gather_positions, write_to_cache
from graphattn.buckets import BucketPolicy
from graphattn.keys import CaptureSupport, GraphKey
from graphattn.metadata import CommonAttentionMetadata
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import no_host_sync


@dataclass(slots=True)
class WindowMetadata(BackendMetadata):
    """Per-token dense attention over the first `width` positions of its row."""

    tensor_fields: ClassVar[tuple[str, ...]] = ("positions", "rows", "block_table",
                                                "slot_mapping")
    pad_values: ClassVar[dict] = {"slot_mapping": -1}
    width: int
    positions: torch.Tensor
    rows: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class WindowBuilder:
    def __init__(self, ctx: BuilderContext) -> None:
        self.buckets = ctx.length_buckets

    def build(self, common: CommonAttentionMetadata, key: GraphKey | None = None):
        width = key.max_len_bucket if key is not None else self.buckets.bucket(common.max_seq_len)
        t = common.num_tokens_padded
        tok = torch.arange(t, device=common.query_start_loc.device, dtype=torch.int32)
        rows = (torch.searchsorted(common.query_start_loc[1:].contiguous(), tok, right=True)
                .clamp(max=common.num_reqs - 1).long())
        pos = common.seq_lens[rows] - (common.query_start_loc[rows + 1] - tok)
        return WindowMetadata(width, pos.long(), rows, common.block_table_tensor,
                              common.slot_mapping)


class WindowImpl:
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int) -> None:
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5

    def forward(self, q, k, v, kv_cache, meta: WindowMetadata) -> torch.Tensor:
        kc, vc = kv_cache
        write_to_cache(kc, meta.slot_mapping, k)
        write_to_cache(vc, meta.slot_mapping, v)
        span = torch.arange(meta.width, device=q.device).expand(q.shape[0], -1)
        keys = gather_positions(kc, meta.block_table[meta.rows], span)
        vals = gather_positions(vc, meta.block_table[meta.rows], span)
        keys = keys.repeat_interleave(self.group, 2)
        vals = vals.repeat_interleave(self.group, 2)
        cdt = torch.promote_types(q.dtype, torch.float32)
        s = torch.einsum("thd,tlhd->thl", q.to(cdt), keys.to(cdt)) * self.scale
        s = s.masked_fill((span > meta.positions[:, None])[:, None], float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        return torch.einsum("thl,tlhd->thd", p, vals.to(cdt)).to(q.dtype)


register_backend("window_test", BackendSpec(WindowBuilder, WindowImpl, WindowMetadata,
                                            CaptureSupport.ALWAYS))


def test_out_of_tree_backend_runs_through_runner_and_capture():
    torch.manual_seed(0)
    cfg = TinyConfig(vocab_size=64, hidden_size=32)
    model = TinyDecoder(cfg, WindowImpl(cfg.num_heads, cfg.head_dim, cfg.num_kv_heads)).double()
    st = RequestState(4, 64, 8)
    model.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    runner = GraphRunner(model, st, RunnerConfig(backend="window_test", policy=BucketPolicy(
        capture_sizes=(2, 4), length_boundaries=(32,), mixed_token_sizes=(16,))))
    assert isinstance(runner.builder, WindowBuilder)
    assert runner.capture(progress=False).num_graphs == 6
    prompts = {runner.add_request(f"r{i}", np.arange(3 + i) % 64): list(np.arange(3 + i) % 64)
               for i in range(3)}
    slots = np.array(sorted(prompts), np.int32)
    sched = SchedulerOutput(slots, np.array([len(prompts[s]) for s in slots]))
    for _ in range(4):
        with no_host_sync():
            out = runner.step(sched)
        assert out.key is not None
        for j, s in enumerate(slots):
            ref = model.reference_logits(torch.tensor(prompts[s]))[-1]
            torch.testing.assert_close(out.logits[j], ref, rtol=1e-9, atol=1e-9)
            prompts[s].append(int(out.sampled[j]))
        sched = SchedulerOutput(slots, np.ones(3, np.int32))
    assert runner.graphs.num_replays == 4
