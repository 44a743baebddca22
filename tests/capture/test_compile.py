import os

import pytest
import torch

from graphattn.compile import BucketCompiler, RecompileError, pin_triton_cache
from graphattn.keys import GraphKey


def fwd(inputs, key):
    return inputs["x"][:, : key.max_len_bucket].sum(-1) * key.num_reqs_padded


def test_compiles_once_per_key_and_fails_loudly_after_freeze():
    torch._dynamo.reset()
    c = BucketCompiler(fwd, backend="eager")
    keys = [GraphKey(r, r, b, True) for r in (1, 2, 4) for b in (4, 8)]
    for k in keys:
        for _ in range(2):
            c({"x": torch.randn(k.num_tokens_padded, 8)}, k)
    assert c.num_compiles == len(keys)
    c.freeze()
    for k in keys:  # steady state: same keys, new instances and data
        c({"x": torch.randn(k.num_tokens_padded, 8)}, GraphKey(*(getattr(k, f) for f in
                                                                  k.__slots__)))
    assert c.num_compiles == len(keys)
    with pytest.raises(RecompileError, match="steady-state recompile after 6 compiles"):
        c({"x": torch.randn(8, 8)}, GraphKey(8, 8, 8, True))


def test_more_keys_than_dynamo_default_limit():
    torch._dynamo.reset()
    c = BucketCompiler(fwd, backend="eager", max_compiles=64)
    for r in range(1, 21):
        c({"x": torch.randn(r, 4)}, GraphKey(r, r, 4, True))
    assert c.num_compiles == 20


def test_steady_state_block():
    torch._dynamo.reset()
    c = BucketCompiler(fwd, backend="eager")
    c({"x": torch.randn(2, 4)}, GraphKey(2, 2, 4, True))
    with c.steady_state(), pytest.raises(RecompileError):
        c({"x": torch.randn(3, 4)}, GraphKey(3, 3, 4, True))
    assert not c.frozen


def _kv_forward_setup(device):
    from graphattn.backends.paged import PagedAttentionImpl, PagedAttentionMetadata
    from graphattn.backends.reference import allocate_kv_cache

    impl = PagedAttentionImpl(4, 16, 2)
    caches = tuple(allocate_kv_cache(8, 4, 2, 16, torch.float32, device) for _ in range(2))

    def forward(inputs, key):
        meta = PagedAttentionMetadata(
            num_decodes=key.num_reqs_padded, num_decode_tokens=key.num_tokens_padded,
            decode_query_len=key.query_len, max_len=key.max_len_bucket,
            num_kv_blocks=key.max_len_bucket // 4, shared_prefix=0, shared_rows=None,
            **{f: inputs[f] for f in PagedAttentionMetadata.tensor_fields})
        return impl.forward(inputs["q"], inputs["k"], inputs["v"], caches, meta)

    return forward, caches


def _kv_inputs(key, device, gen, seq_lens):
    r = key.num_reqs_padded
    bt = torch.arange(r * 2, dtype=torch.int32).view(r, 2)
    pos = torch.tensor(seq_lens) - 1
    return {"q": torch.randn(r, 4, 16, generator=gen).to(device),
            "k": torch.randn(r, 2, 16, generator=gen).to(device),
            "v": torch.randn(r, 2, 16, generator=gen).to(device),
            "query_start_loc": torch.arange(r + 1, dtype=torch.int32).to(device),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32).to(device),
            "block_table": bt.to(device),
            "slot_mapping": (bt[torch.arange(r), pos // 4].long() * 4 + pos % 4).to(device)}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compiled_forward_writing_kv_in_place_is_captured(device):
    """The compiled forward mutates the KV cache; our manager captures it (on CUDA: a real
    graph, where plain reduce-overhead would skip cudagraphs for mutated inputs)."""
    from graphattn.capture.graphs import CUDAGraphManager

    torch._dynamo.reset()
    forward, caches = _kv_forward_setup(device)
    compiled = BucketCompiler(forward, backend="inductor")
    mgr = CUDAGraphManager(compiled, device, pad_values={"slot_mapping": -1,
                                                        "query_start_loc": "edge"})
    gen = torch.Generator().manual_seed(0)
    keys = [GraphKey(2, 2, 8, True), GraphKey(4, 4, 8, True)]
    mgr.capture(keys, lambda k: _kv_inputs(k, device, gen, [1] * k.num_reqs_padded))
    assert compiled.num_compiles == 2
    compiled.freeze()
    for lens in ([3, 5, 2, 7], [4, 6, 3, 8], [5, 1, 4, 8]):
        key = keys[1]
        live = _kv_inputs(key, device, gen, lens)
        eager_caches = tuple(c.clone() for c in caches)
        out = mgr.replay(key, live, 4)
        ref_forward, ref_caches = _kv_forward_setup(device)
        for c, e in zip(ref_caches, eager_caches, strict=True):
            c.copy_(e)
        ref = ref_forward(live, key)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        for c, e in zip(caches, ref_caches, strict=True):  # the in-place write happened
            torch.testing.assert_close(c[:-1], e[:-1])
    assert compiled.num_compiles == 2  # no steady-state recompile


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_runner_compile_writes_caches_in_place_with_no_recompile(device):
    """GraphRunner(compile=True): inductor code calls the attention custom op
    (rope_paged_attention, fused for decode rows where it pays) on the cache buffers
    themselves (no copy of any cache), one compile serves both length buckets of the batch
    shape (the bounds reach the op as a CPU tensor; on CUDA the op decides there whether
    fusing pays), and steady-state steps never recompile."""
    import numpy as np
    from torch._inductor.utils import run_and_get_code

    from graphattn import GraphRunner, RunnerConfig
    from graphattn.buckets import BucketPolicy
    from graphattn.models.tiny import TinyConfig, TinyDecoder
    from graphattn.state import RequestState, SchedulerOutput

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=2)).to(device)
    st = RequestState(2, 32, 8, device)
    model.allocate_caches(8, 8)
    runner = GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(capture_sizes=(2,),
                                                        length_boundaries=(16,)), compile=True))
    report, codes = run_and_get_code(runner.capture, progress=False)
    assert report.num_graphs == 2 and runner.compiler.num_compiles == 1
    code = "\n".join(codes)
    assert code.count("torch.ops.graphattn.rope_paged_attention.default(") == 2  # 2 layers
    assert "index_copy" not in code and ".copy_(" not in code  # no cache is copied
    seq = {runner.add_request("a", [3, 1, 4]): [3, 1, 4], runner.add_request("b", [5, 9]): [5, 9]}
    slots = np.array(sorted(seq), np.int32)
    sched = SchedulerOutput(slots, np.array([len(seq[s]) for s in slots]))
    for _ in range(5):
        out = runner.step(sched)  # prefill runs eagerly: no key; decodes replay compiled code
        for j, s in enumerate(slots):
            ref = model.reference_logits(torch.tensor(seq[s], device=device))[-1]
            tol = 1e-4 if device == "cpu" else 2e-3  # Triton's float32 dots on CUDA
            torch.testing.assert_close(out.logits[j], ref, rtol=tol, atol=tol)
            seq[s].append(int(out.sampled[j]))
        sched = SchedulerOutput(slots, np.ones(2, np.int32))
    assert runner.compiler.num_compiles == 1


@pytest.mark.cuda
def test_compiled_kernels_launch_with_pdl_and_stay_right():
    """CompileConfig(pdl=True): inductor's Triton kernels wait for their inputs in the kernel
    (gdc_wait) and the replayed steps give the reference logits, with no host read."""
    import numpy as np
    from torch._inductor.utils import run_and_get_code

    from graphattn import CompileConfig, GraphRunner, RunnerConfig
    from graphattn.buckets import BucketPolicy
    from graphattn.models.tiny import TinyConfig, TinyDecoder
    from graphattn.state import RequestState, SchedulerOutput
    from graphattn.sync import no_host_sync

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability >= 9")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=2)).cuda()
    st = RequestState(2, 32, 8, "cuda")
    model.allocate_caches(8, 8)
    runner = GraphRunner(model, st, RunnerConfig(
        policy=BucketPolicy(capture_sizes=(2,), length_boundaries=(16,)),
        compile=CompileConfig(enabled=True, pdl=True)))
    _, codes = run_and_get_code(runner.capture, progress=False)
    assert "gdc_wait" in "\n".join(codes)
    seq = {runner.add_request("a", [3, 1, 4]): [3, 1, 4], runner.add_request("b", [5, 9]): [5, 9]}
    slots = np.array(sorted(seq), np.int32)
    sched = SchedulerOutput(slots, np.array([len(seq[s]) for s in slots]))
    for i in range(5):
        with no_host_sync():
            out = runner.step(sched)
        assert out.replayed == (i > 0)
        for j, s in enumerate(slots):
            ref = model.reference_logits(torch.tensor(seq[s], device="cuda"))[-1]
            torch.testing.assert_close(out.logits[j], ref, rtol=2e-3, atol=2e-3)
            seq[s].append(int(out.sampled[j]))
        sched = SchedulerOutput(slots, np.ones(2, np.int32))


def _size_options_runner(monkeypatch, sizes, compile_cfg):
    """A one-layer tiny runner over `sizes` whose inductor compiles only record
    ``max_autotune`` (in the returned list) and run their graph as is; captured."""
    import torch._inductor.compile_fx as compile_fx_module

    from graphattn import GraphRunner, RunnerConfig
    from graphattn.buckets import BucketPolicy
    from graphattn.models.tiny import TinyConfig, TinyDecoder
    from graphattn.state import RequestState

    seen = []

    def fake_compile_fx(gm, example_inputs, **kwargs):
        seen.append(torch._inductor.config.max_autotune)
        return gm.forward

    monkeypatch.setattr(compile_fx_module, "compile_fx", fake_compile_fx)
    torch._dynamo.reset()
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=1))
    st = RequestState(max(sizes), 32, 8)
    model.allocate_caches(4 * max(sizes), 8)
    runner = GraphRunner(model, st, RunnerConfig(
        policy=BucketPolicy(capture_sizes=sizes, length_boundaries=(32,)), compile=compile_cfg))
    runner.capture(progress=False)
    return runner, model, seen


def test_size_options_reach_the_compile_of_their_batch_shape_only(monkeypatch):
    """CompileConfig.size_options: the batch-1 decode compiles under its own inductor
    options (here max_autotune), the batch-2 one under the global options."""
    import numpy as np

    from graphattn import CompileConfig
    from graphattn.state import SchedulerOutput

    runner, model, seen = _size_options_runner(monkeypatch, (1, 2), CompileConfig(
        enabled=True, size_options={1: {"max_autotune": True}}))
    # the step twice, one compile with max_autotune; prepare's device half (the assembler)
    # twice, with the global options
    assert runner.compiler.num_compiles == 2 and sorted(seen) == [False, False, False, True]
    a = runner.add_request("a", [3, 1, 4])
    runner.step(SchedulerOutput(np.array([a]), np.array([3])))
    out = runner.step(SchedulerOutput(np.array([a]), np.array([1])))
    ref = model.reference_logits(torch.tensor([3, 1, 4, int(runner.token_ids[a, 3])]))[-1]
    torch.testing.assert_close(out.logits[0], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("regions", ["step", "blocks"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_dynamic_compile_serves_every_batch_shape_from_shared_code(device, regions):
    """CompileConfig(dynamic=True): the decode keys of 1 to 4 rows and a mixed key replay
    graphs captured from one compiled step (batch 1 too: its size is not specialized; the
    mixed key too: the attention op picks its path when it runs), every row gives the
    reference logits with no host read, and steady steps never recompile. With regions
    "blocks" the three layers share that compile, and the model's layers keep their own
    forward outside the runner's compiled steps."""
    import numpy as np

    from graphattn import CompileConfig, GraphRunner, RunnerConfig
    from graphattn.buckets import BucketPolicy
    from graphattn.models.tiny import TinyConfig, TinyDecoder
    from graphattn.state import RequestState, SchedulerOutput
    from graphattn.sync import no_host_sync

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=3)).to(device)
    st = RequestState(4, 32, 8, device)
    model.allocate_caches(16, 8)
    runner = GraphRunner(model, st, RunnerConfig(
        policy=BucketPolicy(capture_sizes=(1, 2, 3, 4), length_boundaries=(32,),
                            mixed_token_sizes=(24,)),
        compile=CompileConfig(enabled=True, dynamic=True, regions=regions)))
    assert runner.capture(progress=False).num_graphs == 5
    assert runner.compiler.num_compiles == 1
    assert not any("forward" in vars(layer) for layer in model.layers)
    rng = np.random.default_rng(0)
    seq = {}
    for name in "abcd":
        prompt = rng.integers(0, 64, int(rng.integers(2, 6))).tolist()
        seq[runner.add_request(name, prompt)] = prompt
    slots = np.array(sorted(seq), np.int32)
    with no_host_sync():
        out = runner.step(SchedulerOutput(slots, np.array([len(seq[s]) for s in slots])))
    assert out.replayed and not out.key.uniform_decode
    tol = 1e-4 if device == "cpu" else 2e-3
    for j, s in enumerate(slots):
        ref = model.reference_logits(torch.tensor(seq[s], device=device))[-1]
        torch.testing.assert_close(out.logits[j], ref, rtol=tol, atol=tol)
        seq[s].append(int(out.sampled[j]))
    for n in (3, 1, 4, 2, 4):
        live = np.sort(rng.choice(slots, n, replace=False)).astype(np.int32)
        with no_host_sync():
            out = runner.step(SchedulerOutput(live, np.ones(n, np.int32)))
        assert out.replayed
        for j, s in enumerate(live):
            ref = model.reference_logits(torch.tensor(seq[s], device=device))[-1]
            torch.testing.assert_close(out.logits[j], ref, rtol=tol, atol=tol)
            seq[s].append(int(out.sampled[j]))
    assert runner.compiler.num_compiles == 1


def test_size_options_compile_statically_under_dynamic_shapes(monkeypatch):
    """CompileConfig(dynamic=True, size_options={2: ...}): batch 2 compiles on its own with
    its options; batches 1 and 3 share one compile under the global options."""
    import numpy as np

    from graphattn import CompileConfig
    from graphattn.state import SchedulerOutput

    runner, model, seen = _size_options_runner(monkeypatch, (1, 2, 3), CompileConfig(
        enabled=True, dynamic=True, size_options={2: {"max_autotune": True}}))
    # the step twice, prepare's device half (the assembler) once, shared
    assert runner.compiler.num_compiles == 2 and sorted(seen) == [False] * 2 + [True]
    a, b = runner.add_request("a", [3, 1, 4]), runner.add_request("b", [2, 7])
    runner.step(SchedulerOutput(np.array([a, b]), np.array([3, 2])))
    out = runner.step(SchedulerOutput(np.array([a, b]), np.array([1, 1])))
    assert out.replayed and runner.compiler.num_compiles == 2
    ref = model.reference_logits(torch.tensor([3, 1, 4, int(runner.token_ids[a, 3])]))[-1]
    torch.testing.assert_close(out.logits[0], ref, rtol=1e-4, atol=1e-4)


def test_static_marks_cover_held_tensors_for_the_block_only():
    """static_marks: every tensor reachable from the roots (module attributes, lists of
    tuples, slots, closures, bound methods) is static inside the block and unmarked after;
    parameters are left as dynamo treats them, tensors their owner marked keep the marks."""
    from graphattn.compile import static_marks

    class Slotted:
        __slots__ = ("t",)

        def __init__(self, t):
            self.t = t

    model = torch.nn.Linear(2, 2)
    model.caches = [(torch.zeros(3), torch.zeros(4))]
    held, in_closure, owned = torch.zeros(5), torch.zeros(6), torch.zeros(7)
    torch._dynamo.mark_dynamic(owned, 0)

    def closure():
        return in_closure

    roots = (model.forward, Slotted(held), closure, {"owned": owned})
    tensors = [*model.caches[0], held, in_closure]
    with static_marks(*roots):
        assert all(t._dynamo_static_indices == {0} for t in tensors)
        assert not hasattr(owned, "_dynamo_static_indices")
    assert not any(hasattr(t, "_has_dynamo_dim_marking") for t in tensors)
    assert owned._dynamo_dynamic_indices == {0}


def test_repeated_blocks_finds_the_layers_or_refuses_naming_why():
    """repeated_blocks: a forward's own `repeated_blocks`, else its (or its modules') largest
    ModuleList of one class; a model without one, blocks of mixed classes or a block whose
    forward is patched on the instance are refused when the runner is built."""
    from graphattn import CompileConfig, GraphRunner, RunnerConfig
    from graphattn.buckets import BucketPolicy
    from graphattn.compile import repeated_blocks
    from graphattn.models.tiny import TinyConfig, TinyDecoder
    from graphattn.state import RequestState

    model = TinyDecoder(TinyConfig(vocab_size=64, hidden_size=32, num_layers=2))
    assert repeated_blocks(model) == list(model.layers)

    class Holder:  # a wrapper holding the model, as HFCausalLM does
        def __init__(self, m):
            self.model = m

    assert repeated_blocks(Holder(model)) == list(model.layers)
    with pytest.raises(ValueError, match="Linear has no ModuleList of two or more blocks"):
        repeated_blocks(torch.nn.Linear(2, 2))
    model.repeated_blocks = [model.layers[0], model.norm]
    with pytest.raises(ValueError, match=r"must be modules of one class, got \['RMSNorm', "):
        repeated_blocks(model)
    del model.repeated_blocks
    model.layers[1].forward = model.layers[1].forward
    st = RequestState(2, 32, 8)
    model.allocate_caches(8, 8)
    with pytest.raises(ValueError, match="_Layer block has a forward of its own"):
        GraphRunner(model, st, RunnerConfig(policy=BucketPolicy(capture_sizes=(1,)),
                                            compile=CompileConfig(enabled=True,
                                                                  regions="blocks")))


def test_regions_are_validated():
    from graphattn import CompileConfig

    with pytest.raises(ValueError, match=r"regions must be one of \('step', 'blocks'\), got "
                                         r"'layers'"):
        CompileConfig(enabled=True, regions="layers")


def test_calls_block_enters_the_call_settings_once():
    """BucketCompiler.calls(): the static marks (and dynamo's settings) hold for the whole
    block, calls inside it run under them and compile as plain calls do, and they are gone
    after it."""
    torch._dynamo.reset()

    class Holder:
        def __init__(self):
            self.cache = torch.zeros(4)

    held = Holder()
    c = BucketCompiler(lambda x, h: x * 2 + h.cache.sum(), backend="eager", dynamic=True,
                       static_roots=(held,))
    with c.calls():
        assert held.cache._dynamo_static_indices == {0}
        with c.calls():  # nested: one entry still
            outs = [c(torch.ones(n, 4), held) for n in (2, 3, 5)]
        assert hasattr(held.cache, "_dynamo_static_indices")
    assert not hasattr(held.cache, "_dynamo_static_indices")
    assert c.num_compiles == 1 and [tuple(o.shape) for o in outs] == [(2, 4), (3, 4), (5, 4)]
    assert c(torch.ones(7, 4), held).shape == (7, 4) and c.num_compiles == 1


def test_triton_cache_is_pinned_to_inductors_folder_on_cuda_only(monkeypatch):
    """A warm start that loads every graph from inductor's caches must find graphattn's
    kernels where the cold start put them: inductor's folder, set before anything compiles."""
    from torch._inductor.runtime.runtime_utils import triton_cache_dir

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert pin_triton_cache(torch.device("cpu")) is None
    assert "TRITON_CACHE_DIR" not in os.environ
    expected = triton_cache_dir(1)
    assert pin_triton_cache(torch.device("cuda", 1)) == expected
    assert os.environ["TRITON_CACHE_DIR"] == expected
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")  # the user's choice stands
    assert pin_triton_cache(torch.device("cuda", 0)) == "/somewhere/else"
