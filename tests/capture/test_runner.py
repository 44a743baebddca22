import numpy as np
import pytest
import torch

from graphattn import BucketPolicy, GraphRunner, RunnerConfig
from graphattn.backends.flex import FlexAttentionBuilder, FlexAttentionImpl
from graphattn.buckets import LengthBuckets
from graphattn.capture.graphs import GraphNotCapturedError
from graphattn.keys import GraphKey
from graphattn.models.tiny import TinyConfig, TinyDecoder
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import count_host_syncs, no_host_sync


def make_runner(device="cpu", dtype=torch.float64, max_reqs=6, max_len=96, bs=8,
                backend="paged", **policy):
    torch.manual_seed(0)
    cfg = TinyConfig(vocab_size=128, hidden_size=64)
    pol = BucketPolicy(**{"capture_sizes": (1, 2, 4, 8), "length_boundaries": (32, 64),
                          "mixed_token_sizes": (16, 32), **policy})
    st = RequestState(max_reqs, max_len, bs, device)
    impl = builder = None
    if backend == "flex":  # compiled on CUDA (128-wide mask tiles), reference on CPU
        impl = FlexAttentionImpl(cfg.num_heads, cfg.head_dim, cfg.num_kv_heads)
        builder = FlexAttentionBuilder(bs, LengthBuckets(max_len, pol.length_boundaries),
                                       mask_block_size=128 if device == "cuda" else 16)
    model = TinyDecoder(cfg, impl).to(device, dtype)
    model.allocate_caches(max_reqs * st.max_num_blocks_per_req, bs)
    return model, st, GraphRunner(model, st, RunnerConfig(backend=backend, policy=pol),
                                  builder=builder)


def drive(model, st, runner, steps, rng, tol, check_every=1, max_prompt=30, max_chunk=24):
    """Random joins, chunked prefills and decodes; logits checked against a dense forward."""
    seqs: dict[int, list[int]] = {}
    prompts: dict[int, int] = {}
    next_id, keys, graph_steps = 0, set(), 0
    runner.padded_eager_steps = 0
    for step in range(steps):
        while st.num_active < st.max_num_reqs and rng.random() < 0.5:
            p = rng.integers(0, 128, int(rng.integers(2, max_prompt)))
            slot = runner.add_request(f"r{next_id}", p)
            next_id += 1
            seqs[slot], prompts[slot] = list(p), len(p)
        for rid, slot in list(st.req_id_to_slot.items()):
            if st.num_computed_tokens_np[slot] >= prompts[slot] + int(rng.integers(3, 12)) or \
                    st.num_computed_tokens_np[slot] + 1 >= st.max_model_len:
                st.remove_request(rid)
                del seqs[slot]
        slots = np.array(sorted(st.req_id_to_slot.values()), np.int32)
        if slots.size == 0:
            continue
        left = np.array([prompts[s] - st.num_computed_tokens_np[s] for s in slots])
        chunk = np.where(left > 0, np.minimum(left, rng.integers(1, max_chunk, slots.size)), 1)
        sched = SchedulerOutput(slots, chunk)
        with no_host_sync():
            out = runner.step(sched)
        keys.add(out.key)
        graph_steps += out.replayed
        runner.padded_eager_steps += out.key is not None and not out.replayed
        if step % check_every == 0 or out.replayed:
            logits = out.logits.double().cpu()
            for j, s in enumerate(slots):
                n = int(st.num_computed_tokens_np[s])
                if n >= prompts[s]:
                    ref = model.reference_logits(torch.tensor(seqs[s][:n], device=st.device))
                    torch.testing.assert_close(logits[j], ref[-1].double().cpu(), **tol)
        sampled = out.sampled.cpu().tolist()
        for j, s in enumerate(slots):
            if st.num_computed_tokens_np[s] >= prompts[s]:
                seqs[s].append(sampled[j])
    return keys, graph_steps


@pytest.mark.parametrize("backend", ["paged", "flex"])
def test_tiny_decoder_matches_dense_reference_on_cpu(backend):
    model, st, runner = make_runner(backend=backend)
    report = runner.capture()
    assert report.num_graphs == (4 + 2) * 3
    keys, graph_steps = drive(model, st, runner, 40, np.random.default_rng(0),
                              dict(rtol=1e-9, atol=1e-9))
    assert None in keys and graph_steps > 10
    assert any(k is not None and not k.uniform_decode for k in keys)
    assert 0 <= runner.padding.token_waste < 1


def test_zero_host_syncs_per_step_and_dummy_run():
    model, st, runner = make_runner()
    runner.capture()
    runner.add_request("a", [1, 2, 3])
    runner.add_request("b", [4, 5])
    runner.step(SchedulerOutput(np.array([0, 1]), np.array([3, 2])))
    with count_host_syncs() as c:
        for _ in range(5):
            out = runner.step(SchedulerOutput(np.array([0, 1]), np.array([1, 1])))
            runner.dummy_run(GraphKey(8, 8, 32, True))
    assert c.count == 0 and out.key == GraphKey(2, 2, 32, True)


def test_dummy_run_changes_no_state():
    """All rows padded: slot -1 writes go to the sink, sampled tokens to the spare
    column, the device truth advances by 0."""
    model, st, runner = make_runner()
    runner.capture()
    runner.add_request("a", [1, 2, 3])
    runner.step(SchedulerOutput(np.array([0]), np.array([3])))
    before = ([c[:-1].clone() for pair in model.caches for c in pair],
              runner.token_ids[:, :-1].clone(), st.num_computed_tokens.clone())
    with no_host_sync():
        for key in runner.graphs.keys:
            runner.dummy_run(key)
    after = ([c[:-1] for pair in model.caches for c in pair], runner.token_ids[:, :-1],
             st.num_computed_tokens)
    for b, a in zip(before[0], after[0], strict=True):
        assert torch.equal(b, a)
    assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])
    assert st.num_computed_tokens_np[0] == 3


def test_uncaptured_key_runs_eager_at_its_padded_shapes():
    model, st, runner = make_runner(length_boundaries=(16, 64))
    runner.capture([k for k in runner.dispatcher.all_keys() if k.max_len_bucket != 16])
    keys, graph_steps = drive(model, st, runner, 40, np.random.default_rng(3),
                              dict(rtol=1e-9, atol=1e-9))
    assert graph_steps > 5 and runner.padded_eager_steps > 0
    assert runner.graphs.num_eager == runner.padded_eager_steps


def test_missing_graph_error_and_bad_config():
    model, st, runner = make_runner()
    runner.graphs.on_missing = "error"
    runner.add_request("a", [1, 2, 3])
    with pytest.raises(GraphNotCapturedError, match="no graph captured"):
        runner.step(SchedulerOutput(np.array([0]), np.array([3])))
    with pytest.raises(ValueError, match="static_input_names = .*'pixels'.*expected a subset"):
        GraphRunner(model, st, RunnerConfig(static_input_names=("input_ids", "pixels")))
    with pytest.raises(ValueError, match="backend = 'cross' needs a CrossAttentionImpl"):
        GraphRunner(model, st, RunnerConfig(backend="cross"))
    with pytest.raises(ValueError, match="unknown backend 'pagd'"):
        GraphRunner(model, st, RunnerConfig(backend="pagd"))
    with pytest.raises(TypeError, match="has no build"):
        GraphRunner(model, st, builder=object())
    with pytest.raises(ValueError, match="decode_query_len = 0"):
        BucketPolicy(decode_query_len=0)


def test_largest_capture_size_and_one_past_it_run_eager():
    model, st, runner = make_runner(max_reqs=9, mixed_token_sizes=())
    runner.capture()
    for i in range(9):
        runner.add_request(f"r{i}", [i + 1, 2])
    runner.step(SchedulerOutput(np.arange(9), np.full(9, 2, np.int32)))
    out8 = runner.step(SchedulerOutput(np.arange(8), np.ones(8, np.int32)))
    assert out8.key == GraphKey(8, 8, 32, True)
    out9 = runner.step(SchedulerOutput(np.arange(9), np.ones(9, np.int32)))
    assert out9.key is None and out9.logits.shape == (9, 128)


@pytest.mark.cuda
def test_cuda_graphs_1000_random_steps_match_eager():
    model, st, runner = make_runner("cuda", torch.float32, max_reqs=8, max_len=128)
    report = runner.capture()
    assert report.num_graphs == 18 and report.pool_bytes > 0
    # each step runs inside no_host_sync(), i.e. under set_sync_debug_mode("error")
    keys, graph_steps = drive(model, st, runner, 1000, np.random.default_rng(1),
                              dict(rtol=2e-3, atol=2e-3), check_every=10)
    assert graph_steps > 500 and len(keys) > 5


@pytest.mark.cuda
def test_cuda_graphs_flex_runner_matches_dense_reference():
    """Compiled flex captured per key, block masks built inside the graph; every step
    fits a key (<= 16 tokens, lengths <= 64), so no eager step compiles a new shape."""
    model, st, runner = make_runner("cuda", torch.float32, max_reqs=4, max_len=64,
                                    backend="flex", capture_sizes=(2, 4),
                                    length_boundaries=(32,), mixed_token_sizes=(16,))
    report = runner.capture()
    assert report.num_graphs == 6
    compiles = model.impl.compiler.num_compiles
    model.impl.compiler.freeze()  # steady state: a new shape would raise RecompileError
    keys, graph_steps = drive(model, st, runner, 150, np.random.default_rng(2),
                              dict(rtol=2e-3, atol=2e-3), max_prompt=14, max_chunk=5)
    assert None not in keys and graph_steps > 100
    assert model.impl.compiler.num_compiles == compiles


def test_whole_runner_step_on_meta_device():
    model, st, runner = make_runner(device="meta", dtype=torch.float32)
    runner.capture()
    runner.add_request("a", [1, 2, 3, 4])
    runner.add_request("b", [5, 6])
    with no_host_sync():
        first = runner.step(SchedulerOutput(np.array([0, 1]), np.array([4, 2])))
        out = runner.step(SchedulerOutput(np.array([0, 1]), np.array([1, 1])))
        runner.dummy_run(GraphKey(4, 4, 32, True))
    assert first.logits.device.type == "meta" and out.key == GraphKey(2, 2, 32, True)
    assert out.logits.shape == (2, 128) and st.num_computed_tokens_np[:2].tolist() == [5, 3]


def test_the_lm_head_runs_only_where_logits_are_used():
    """A forward that reads logits_indices computes the LM head at each row's last token (at
    most max_num_reqs rows, whatever the key's padded tokens); one that does not is still
    served, and both give the same logits."""
    outs, rows = {}, {}
    for names in (None, ("input_ids", "positions")):
        model, st, _ = make_runner(max_reqs=4)
        runner = GraphRunner(model, st, RunnerConfig(static_input_names=names, policy=BucketPolicy(
            capture_sizes=(1, 2, 4), length_boundaries=(32, 64), mixed_token_sizes=(16, 32))))
        runner.capture(progress=False)
        seen = []
        model.lm_head.register_forward_hook(lambda m, a, out, seen=seen: seen.append(len(a[0])))
        for i, n in enumerate((5, 9, 3)):
            runner.add_request(f"r{i}", np.arange(1, n + 1))
        with no_host_sync():
            out = runner.step(SchedulerOutput(np.arange(3), np.array([5, 9, 3])))
        assert out.key == GraphKey(32, 32, 32, False)
        outs[names], rows[names] = out.logits.clone(), seen[-1]
    assert rows[None] == 4 and rows[("input_ids", "positions")] == 32
    torch.testing.assert_close(outs[None], outs[("input_ids", "positions")], rtol=0, atol=0)
