import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.workload import WorkloadConfig
from graphattn.backends.paged import PagedAttentionBuilder, PagedAttentionImpl
from graphattn.backends.reference import allocate_kv_cache
from graphattn.keys import GraphKey
from graphattn.sync import no_host_sync
from graphattn.ubatch import maybe_create_ubatch_slices, split_attn_metadata
from tests.graphattn.backends.harness import Scenario, dense_attention
from tests.helpers import two_request_batch

H, HKV, D = 4, 2, 8
CFGS = {
    "mixed": WorkloadConfig(prompt_len=(3, 40), token_budget=40),
    "spec_async": WorkloadConfig(num_spec_tokens=2, feedback_delay=3, token_budget=48),
}


def check_step(sc, impl, builder, caches, pad=(0, 0), ubatches=1, device="cpu"):
    s, batch, common = sc.next_batch(*pad)
    t = batch.num_tokens_padded
    q, k, v = sc.rand(t, H, D), sc.rand(t, HKV, D), sc.rand(t, HKV, D)
    dev = [x.to(device) for x in (q, k, v)]
    with no_host_sync():
        if ubatches > 1 and t >= ubatches:
            slices = maybe_create_ubatch_slices(batch.query_start_loc_np, ubatches, t)
            outs = []
            for sl, part in zip(slices, split_attn_metadata(slices, common), strict=True):
                ts = sl.token_slice
                meta = builder.build(part)
                outs.append(impl.forward(dev[0][ts], dev[1][ts], dev[2][ts], caches, meta))
            out = torch.cat(outs)
        else:
            out = impl.forward(*dev, caches, builder.build(common))
    n = s.total_num_scheduled_tokens
    sc.record(s, batch, torch.stack([k[:n], v[:n]], 1))
    rows, slots, pos = sc.token_views(s, batch)
    for i in range(n):
        kv = sc.logical[int(slots[i])][: pos[i] + 1]
        ref = dense_attention(q[i], kv[:, 0], kv[:, 1], impl.scale)
        torch.testing.assert_close(out[i].cpu().double(), ref, rtol=1e-5, atol=1e-5)
    assert out[n:].abs().sum().item() == 0.0  # padded tokens
    sc.finish(s)
    return batch


@pytest.mark.parametrize("name", sorted(CFGS))
@pytest.mark.parametrize("pad, ubatches", [((0, 0), 1), ((2, 3), 1), ((1, 2), 2)])
def test_matches_dense_reference(name, pad, ubatches):
    sc = Scenario(CFGS[name], seed=hash((name, pad, ubatches)) % 1000)
    caches = tuple(allocate_kv_cache(sc.num_blocks, 8, HKV, D, torch.float64, "cpu")
                   for _ in range(2))
    builder = PagedAttentionBuilder(8, decode_query_len=CFGS[name].num_spec_tokens + 1)
    impl = PagedAttentionImpl(H, D, HKV)
    over = 0
    for _ in range(25):
        b = check_step(sc, impl, builder, caches, pad, ubatches)
        over += int((b.seq_lens_cpu_upper_bound_np > b.seq_lens.numpy()).sum())
    if name == "spec_async":
        assert over > 0


def test_graph_key_plan_and_errors():
    sc = Scenario(WorkloadConfig(prompt_len=(1, 1), max_new_tokens=(5, 5), arrival_prob=1.0), 0)
    builder = PagedAttentionBuilder(8)
    s, batch, common = sc.next_batch()  # 5 one-token prompts: uniform q=1
    sc.finish(s)
    s, batch, common = sc.next_batch(pad_reqs=3, pad_tokens=3)
    key = GraphKey(8, 8, 16, True)
    meta = builder.build(common, key)
    assert (meta.num_decodes, meta.num_decode_tokens, meta.max_len, meta.num_kv_blocks) == (
        8, 8, 16, 2)
    mixed = builder.build(common, GraphKey(8, 8, 32, False))
    assert mixed.num_decodes == 0 and mixed.num_kv_blocks == 4
    with pytest.raises(ValueError, match=r"padded to \(reqs, tokens\) = \(8, 8\), expected "
                                         r"\(4, 4\)"):
        builder.build(common, GraphKey(4, 4, 16, True))
    with pytest.raises(ValueError, match="exceeds the key's bucket 1"):
        builder.build(common, GraphKey(8, 8, 1, True))
    _, _, _, hand = two_request_batch()  # query lens [3, 6, 0, 0], 12 tokens
    with pytest.raises(ValueError, match=r"needs query length 3 in every real row, got \[6\]"):
        builder.build(hand, GraphKey(4, 12, 16, True))
    with pytest.raises(ValueError, match="block_size = 0"):
        PagedAttentionBuilder(0)


def test_builder_on_meta_device():
    sc = Scenario(WorkloadConfig(), 1, device="meta")
    builder = PagedAttentionBuilder(8)
    impl = PagedAttentionImpl(H, D, HKV)
    caches = tuple(allocate_kv_cache(sc.num_blocks, 8, HKV, D, torch.float32, "meta")
                   for _ in range(2))
    for _ in range(5):
        s, batch, common = sc.next_batch(1, 2)
        with no_host_sync():
            meta = builder.build(common)
            out = impl.forward(torch.empty(batch.num_tokens_padded, H, D, device="meta"),
                               torch.empty(batch.num_tokens_padded, HKV, D, device="meta"),
                               torch.empty(batch.num_tokens_padded, HKV, D, device="meta"),
                               caches, meta)
        assert out.shape == (batch.num_tokens_padded, H, D)
        sc.sched.finish_step(s)


class OpNames(TorchDispatchMode):
    """The names of the ops dispatched while it is active (`names`)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("entry", "fused_op", "split_op"), [
    ("forward", "append_paged_attention", "write_kv"),
    ("forward_qkv", "rope_paged_attention", "rope_write_kv")])
def test_forward_runs_one_op_for_decode_and_mixed_batches(entry, fused_op, split_op):
    """`PagedAttentionImpl.forward` (q, k, v) and `forward_qkv` (a fused qkv, rotated in the
    op): one `fused_op` call for decode and mixed batches alike (it picks its path from the
    plan when it runs: the K/V write inside the attention launch for one-token decode rows
    where it pays, on CUDA) unless `fuse_rope=False` (`split_op`, then attention); the same
    output and caches for every `fuse_rope`, under no_host_sync()."""
    from graphattn.backends.rope import inv_frequencies

    inv = inv_frequencies(D, 1e4, "cpu")
    for cfg in (WorkloadConfig(prompt_len=(1, 1), max_new_tokens=(5, 9), arrival_prob=1.0),
                CFGS["mixed"]):
        sc = Scenario(cfg, seed=3, max_model_len=64, block_size=8)
        builder = PagedAttentionBuilder(8)
        caches = tuple(allocate_kv_cache(sc.num_blocks, 8, HKV, D, torch.float32, "cpu")
                       for _ in range(2))
        for c in caches:
            c.normal_()
        for _ in range(3):
            s, batch, common = sc.next_batch()
            meta = builder.build(common)
            qkv = sc.rand(batch.num_tokens_padded, (H + 2 * HKV) * D)
            q, k, v = qkv.view(-1, H + 2 * HKV, D).split([H, HKV, HKV], 1)
            results = []
            for fuse in (None, True, False):
                impl, kv = PagedAttentionImpl(H, D, HKV, fuse_rope=fuse), tuple(
                    c.clone() for c in caches)
                with OpNames() as ops, no_host_sync():
                    out = (impl.forward(q, k, v, kv, meta) if entry == "forward" else
                           impl.forward_qkv(qkv, batch.positions, inv, kv, meta))
                assert (f"graphattn::{fused_op}" in ops.names) == (fuse is not False)
                assert (f"graphattn::{split_op}" in ops.names) == (fuse is False)
                results.append((out, kv))
            for out, kv in results[1:]:
                torch.testing.assert_close(out, results[0][0])
                for x, y in zip(kv, results[0][1], strict=True):
                    torch.testing.assert_close(x, y)
            caches = results[0][1]
            sc.finish(s)
