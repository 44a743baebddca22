"""Prefix caching through GraphRunner: requests that share a prompt prefix share its KV blocks
(read-only for each), prefill only the rest, and give the dense reference's logits; a block
that a holder could still write is never shared."""

import numpy as np
import pytest
import torch

from bench.workload import device_truth
from graphattn import BucketPolicy, GraphRunner, RequestState, RunnerConfig, SchedulerOutput
from graphattn.blocks import BlockManager
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.sync import no_host_sync

BS = 8


def make(decode_query_len=1, shared_prefix_sizes=(), window=0):
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32)).double()
    if window:
        model.impl.window = window
    st = RequestState(4, 64, BS, num_kv_blocks=24)
    model.allocate_caches(st.num_kv_blocks, BS)
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(
        capture_sizes=(2, 4), decode_query_len=decode_query_len, length_boundaries=(64,),
        mixed_token_sizes=(32,), shared_prefix_sizes=shared_prefix_sizes)))
    runner.capture(progress=False)
    return model, st, runner


class NanoManager:
    """A runner's own block manager, nano-vllm style: hash chain -> block, refcounts."""

    def __init__(self, n):
        self.free, self.by_prefix, self.refs, self.of = list(range(n)), {}, {}, {}

    def allocate(self, req, ids, num_tokens):
        hit = []
        while (len(hit) + 1) * BS < len(ids) and tuple(ids[:(len(hit) + 1) * BS]) in (
                self.by_prefix):
            hit.append(self.by_prefix[tuple(ids[:(len(hit) + 1) * BS])])
        blocks = hit + [self.free.pop(0) for _ in range(-(-num_tokens // BS) - len(hit))]
        for b in blocks:
            self.refs[b] = self.refs.get(b, 0) + 1
        self.of[req] = blocks
        return blocks, len(hit) * BS

    def cache(self, req, ids):
        for i, b in enumerate(self.of[req][: len(ids) // BS]):
            self.by_prefix.setdefault(tuple(ids[:(i + 1) * BS]), b)


def serve(runner, manager, prompts, new=6, keys=None, logits=None):
    """Admit each prompt after the previous one's prefill (so later ones hit), decode all
    (each decode step's key and whether it replayed go to `keys`); each decode logit is
    checked against the dense reference, or (`logits` given, a model with a window the
    reference lacks) collected there."""
    st, model = runner.state, runner.forward
    seqs = {}
    for i, p in enumerate(prompts):
        blocks, computed = manager.allocate(f"r{i}", p, len(p) + new + 1)
        slot = runner.add_request(f"r{i}", p, blocks, num_computed_tokens=computed)
        seqs[slot] = list(p)
        with no_host_sync():
            out = runner.step(SchedulerOutput(np.array([slot]), np.array([len(p) - computed])))
        seqs[slot].append(int(out.sampled_host.wait()[0]))
        manager.cache(f"r{i}", seqs[slot][:-1])
    slots = np.array(sorted(seqs), np.int32)
    for _ in range(new):
        with no_host_sync():
            out = runner.step(SchedulerOutput(slots, np.ones(slots.size, np.int32)))
        if keys is not None:
            keys.append((out.key, out.replayed))
        for s, t, logit in zip(slots, out.sampled_host.wait(), out.logits, strict=True):
            if logits is None:
                ref = model.reference_logits(torch.tensor(seqs[s]))[-1]
                torch.testing.assert_close(logit, ref, rtol=1e-9, atol=1e-9)
            else:
                logits.append(logit.clone())
            seqs[s].append(int(t))
    np.testing.assert_array_equal(st.num_computed_tokens_np[slots], device_truth(st)[slots])
    return seqs


@pytest.mark.parametrize("manager", ["graphattn", "nano"])
def test_shared_prefixes_prefill_once_and_match_the_reference(manager):
    _, st, runner = make()
    rng = np.random.default_rng(0)
    system = list(rng.integers(0, 64, 20))
    prompts = [system + list(rng.integers(0, 64, n)) for n in (5, 9, 3)]
    m = BlockManager(st.num_kv_blocks, BS) if manager == "graphattn" else NanoManager(24)
    serve(runner, m, prompts)
    # the system prompt's two full blocks are held by all three requests
    tables = [st.block_table_np[s, :2].tolist() for s in range(3)]
    assert tables[0] == tables[1] == tables[2]
    assert st.holders.count[tables[0]].tolist() == [3, 3]
    if manager == "graphattn":
        assert m.num_hits == 32 and m.ref_count[tables[0]].tolist() == [3, 3]
        m.free("r0")
        st.remove_request("r0")
        assert st.holders.count[tables[0]].tolist() == [2, 2]


@pytest.mark.parametrize("window", [0, 12], ids=["full", "window_inside_prefix"])
def test_shared_prefix_attention_reads_the_prefix_once_and_matches_the_reference(window):
    """Three requests share the system prompt's two full blocks, a fourth shares nothing:
    every decode step replays a key with a 16-token shared prefix (the group's prefix pass
    plus each row's own keys), and every logit is the dense float64 reference's; with a
    12-token window (starting inside the prefix) they are those of the same model without
    shared-prefix attention."""
    rng = np.random.default_rng(1)
    system = list(rng.integers(0, 64, 20))
    prompts = [system + list(rng.integers(0, 64, n)) for n in (5, 9, 3)]
    prompts.append(list(rng.integers(0, 64, 17)))
    keys, got, want = [], [] if window else None, []
    _, st, runner = make(shared_prefix_sizes=(8, 16), window=window)
    serve(runner, BlockManager(st.num_kv_blocks, BS), prompts, keys=keys, logits=got)
    if window:
        _, st2, plain = make(window=window)
        serve(plain, BlockManager(st2.num_kv_blocks, BS), prompts, logits=want)
        torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-9, atol=1e-9)
    assert [k.shared_prefix for k, _ in keys] == [16] * 6 and all(r for _, r in keys)
    assert sum(k.shared_prefix > 0 for k in runner.graphs.keys) == 4  # 2 sizes x 2 batches


def test_a_block_a_holder_may_still_write_is_not_shared():
    _, st, runner = make()
    a = runner.add_request("a", list(range(20)), list(range(3)))
    with pytest.raises(ValueError, match="block 0 is not read-only for another live request"):
        runner.add_request("b", list(range(20)), [0, 3, 4], num_computed_tokens=8)
    runner.step(SchedulerOutput(np.array([a]), np.array([20])))
    b = runner.add_request("b", list(range(20)), [0, 3, 4], num_computed_tokens=8)
    with pytest.raises(ValueError, match=r"blocks \[1\] are held by another live request"):
        runner.add_request("c", list(range(20)), [0, 1, 5], num_computed_tokens=8)
    assert st.holders.count[0] == 2 and st.holders.write_floor[b] == 8
    with pytest.raises(ValueError, match="held by another live request"):
        runner.append_blocks("b", [1])


def test_shared_prefixes_with_speculative_drafts():
    """Drafts make the mirror an upper bound: a holder with pending drafts shares only
    below its lower bound (mirror - pending)."""
    _, st, runner = make(decode_query_len=3)
    m = BlockManager(st.num_kv_blocks, BS)
    prompt = list(range(1, 17))
    blocks, _ = m.allocate("a", prompt, 24)
    a = runner.add_request("a", prompt, blocks)
    runner.step(SchedulerOutput(np.array([a]), np.array([16])))
    out = runner.step(SchedulerOutput(np.array([a]), np.array([3]), np.array([2])),
                      draft_token_ids=[60, 61])  # mirror 19, lower bound 17
    m.cache("a", prompt)
    blocks_b, computed = m.allocate("b", prompt + [5, 6])
    assert computed == 16
    runner.add_request("b", prompt + [5, 6], blocks_b, num_computed_tokens=computed)
    runner.apply_feedback(out)
    assert st.holders.count[blocks[:2]].tolist() == [2, 2]


def test_sharing_with_a_holder_in_a_later_slot_guards_that_holder():
    """The new request takes a lower slot than the block's holder: the holder's write
    floor still rises (a shifted row index once raised the wrong slot's)."""
    _, st, runner = make()
    runner.add_request("x", [1, 2, 3], [10])
    a = runner.add_request("a", list(range(20)), list(range(3)))
    st.remove_request("x")
    runner.step(SchedulerOutput(np.array([a]), np.array([20])))
    b = runner.add_request("b", list(range(20)), [0, 3, 4], num_computed_tokens=8)
    assert (b, a) == (0, 1)
    assert st.holders.write_floor[[b, a]].tolist() == [8, 8]
