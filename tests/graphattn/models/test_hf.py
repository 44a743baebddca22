import copy

import numpy as np
import pytest
import torch

from graphattn import BucketPolicy, CompileConfig, GraphRunner, RunnerConfig
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import no_host_sync

transformers = pytest.importorskip("transformers")


def make(device, dtype, compile=False, policy=None, prepare=None):
    """The reference model, a runner around a wrapped copy (`prepare(copy)` first, when
    given) and its state."""
    from graphattn.models.hf import HFCausalLM

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    ref = transformers.LlamaForCausalLM(cfg).to(device, dtype).eval()
    ref.config._attn_implementation = "eager"
    served = copy.deepcopy(ref)
    if prepare is not None:
        prepare(served)
    hf = HFCausalLM(served)
    st = RequestState(4, 64, 8, device)
    hf.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    policy = policy or BucketPolicy(capture_sizes=(1, 2, 4))
    return ref, GraphRunner(hf, st, RunnerConfig(policy=policy, compile=compile)), st


def run(device, dtype, tol, compile=False, policy=None, runners=None, prepare=None):
    """The runner's logits against the model's own generate() over a chunked prefill and
    decodes of three requests; returns the capture report and each step's key (`runners`:
    a list that receives the runner; `prepare`: `make`'s)."""
    ref, runner, st = make(device, dtype, compile, policy, prepare)
    if runners is not None:
        runners.append(runner)
    report = runner.capture()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n) for n in (5, 11, 3)]
    new = 7
    expected = []
    for p in prompts:
        out = ref.generate(torch.tensor(p, device=device)[None], max_new_tokens=new,
                           do_sample=False, output_logits=True, return_dict_in_generate=True)
        expected.append(torch.stack(out.logits)[:, 0].float().cpu())
    for i, p in enumerate(prompts):
        runner.add_request(f"r{i}", p)
    got = [[] for _ in prompts]
    # step 0: the long prompt is chunk-prefilled (6 + 5 tokens)
    scheds = [SchedulerOutput(np.array([0, 1, 2]), np.array([5, 6, 3])),
              SchedulerOutput(np.array([0, 1, 2]), np.array([1, 5, 1]))]
    scheds += [SchedulerOutput(np.array([0, 1, 2]), np.ones(3, np.int32))] * new
    keys = []
    for sched in scheds:
        with no_host_sync():
            out = runner.step(sched)
        keys.append(out.key)
        for j in range(3):
            done = st.num_computed_tokens_np[j] >= len(prompts[j])
            if done and len(got[j]) < new:
                got[j].append(out.logits[j].float().cpu().clone())
    for j in range(3):
        torch.testing.assert_close(torch.stack(got[j]), expected[j], **tol)
    return report, keys


def test_llama_matches_own_generation_on_cpu():
    _, keys = run("cpu", torch.float32, dict(rtol=1e-4, atol=1e-4))
    assert keys[0] is None and keys[-1] is not None  # eager prefill, then graph keys


@pytest.mark.cuda
def test_llama_cuda_graphs_match_own_generation():
    torch.cuda.set_sync_debug_mode(0)
    report, keys = run("cuda", torch.float32, dict(rtol=2e-3, atol=2e-3))
    assert report.num_graphs > 0 and sum(k is not None for k in keys) >= 6


def test_compiled_llama_compiles_once_per_batch_shape_on_cpu():
    """compile=True around the wrapper: one compile per batch shape, all before the recorded
    runs (a compile there raises RecompileError; the wrapper's calls leave no side effect a
    later call would guard on), and the compiled steps match the model's own generate()."""
    runners = []
    report, keys = run("cpu", torch.float32, dict(rtol=1e-4, atol=1e-4),
                       CompileConfig(enabled=True, backend="eager"), runners=runners)
    assert report.num_graphs > 0 and keys[-1] is not None
    assert runners[0].compiler.num_compiles == 3


def test_compiled_llama_writes_kv_inside_its_attention_op():
    """Inductor's code of the wrapped model calls `append_paged_attention` once a layer (the
    K/V write of decode rows joins the attention launch on CUDA) and neither `write_kv` nor
    any copy of a cache."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, runner, _ = make("cpu", torch.float32, CompileConfig(enabled=True),
                        BucketPolicy(capture_sizes=(1,)))
    _, codes = run_and_get_code(runner.capture, progress=False)
    code = "\n".join(codes)
    assert code.count("torch.ops.graphattn.append_paged_attention.default(") == 2  # 2 layers
    assert "graphattn.write_kv" not in code and "index_copy" not in code


@pytest.mark.slow
@pytest.mark.parametrize("regions", ["step", "blocks"])
def test_dynamic_compile_serves_decode_and_mixed_keys_of_llama_from_one_compile(regions):
    """CompileConfig(dynamic=True) with inductor: the decode keys of 1, 2 and 4 rows (batch 1
    not specialized by the wrapper's views) and the mixed keys share one compiled step, or
    with regions "blocks" one compiled decoder layer for both layers (each reads its caches
    from its own module, not by layer index), and every step matches the model's own
    generate()."""
    policy = BucketPolicy(capture_sizes=(1, 2, 4), mixed_token_sizes=(16,))
    runners = []
    report, keys = run("cpu", torch.float32, dict(rtol=1e-4, atol=1e-4),
                       CompileConfig(enabled=True, dynamic=True, regions=regions), policy,
                       runners)
    assert report.num_graphs > 0 and keys[0] is not None and keys[0].num_tokens_padded == 16
    assert runners[0].compiler.num_compiles == 1


def test_layer_caches_belong_to_their_wrapper_and_never_travel_with_the_model():
    """Each attention module holds its layer's caches for the wrapper that allocated them: a
    second wrapper of the same model takes them over and the first reads its own lists
    again; a deep copy or a pickle of the model holds none."""
    import pickle

    from graphattn.models.hf import LAYER_CACHE, HFCausalLM

    _, runner, _ = make("cpu", torch.float32)
    first, model = runner.forward, runner.forward.model
    attn = model.model.layers[1].self_attn
    assert getattr(attn, LAYER_CACHE).kv is first.caches[1]
    second = HFCausalLM(model)
    second.allocate_caches(8, 8)
    assert second.layer_cache(attn)[0] is second.caches[1]
    assert first.layer_cache(attn)[0] is first.caches[1]
    assert getattr(copy.deepcopy(model).model.layers[1].self_attn, LAYER_CACHE) is None
    assert getattr(pickle.loads(pickle.dumps(model)).model.layers[1].self_attn,
                   LAYER_CACHE) is None


@pytest.mark.cuda
def test_compiled_llama_captures_with_inductor_autotuning_on_cuda():
    """compile=True around a wrapped transformers model on CUDA, with inductor benchmarking
    several configs of its kernels at their first launch (max_autotune_pointwise): every
    compile and every autotuning runs before capture (a synchronize inside a stream capture
    would fail), and the replayed graphs match the model's own generate()."""
    torch.cuda.set_sync_debug_mode(0)
    cfg = CompileConfig(enabled=True, options={"max_autotune_pointwise": True})
    report, keys = run("cuda", torch.float32, dict(rtol=2e-3, atol=2e-3), cfg)
    assert report.num_graphs > 0 and sum(k is not None for k in keys) >= 6


def test_wrapping_changes_nothing_of_the_model_and_refuses_training_mode():
    from graphattn.models.hf import HFCausalLM

    ref, runner, st = make("cpu", torch.float32)
    model = runner.forward.model
    model.train()
    with pytest.raises(ValueError, match="LlamaForCausalLM is in training mode"):
        HFCausalLM(model)
    model.eval()
    HFCausalLM(model)
    assert not model.training


def test_a_model_cast_after_allocate_caches_is_refused():
    ref, runner, st = make("cpu", torch.float32)
    runner.forward.model.double()
    with pytest.raises(ValueError, match=r"caches\[0\]: dtype torch.float32, expected the "
                                         r"model's torch.float64"):
        runner.capture(progress=False)
    with pytest.raises(ValueError, match=r"caches\[0\]: dtype torch.float32"):
        GraphRunner(runner.forward, RequestState(4, 64, 8))


def test_learned_positions_shorter_than_max_model_len_are_refused():
    from graphattn.models.hf import HFCausalLM

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=48)
    hf = HFCausalLM(transformers.GPT2LMHeadModel(cfg).eval())
    assert hf.max_positions == 48
    hf.allocate_caches(32, 8)
    with pytest.raises(ValueError, match=r"max_model_len = 64, but HFCausalLM takes positions "
                                         r"below 48 only"):
        GraphRunner(hf, RequestState(4, 64, 8, num_kv_blocks=31))
    GraphRunner(hf, RequestState(4, 48, 8, num_kv_blocks=31))


def test_hf_models_run_the_paged_backend_only():
    ref, runner, st = make("cpu", torch.float32)
    with pytest.raises(ValueError, match=r"backend = 'flex', but HFCausalLM runs only "
                                         r"\('paged',\)"):
        GraphRunner(runner.forward, st, RunnerConfig(backend="flex"))


def test_kv_scales_calibrate_each_layer_of_an_fp8_cache():
    """kv_scales() after serving a prompt: each layer's max |K| and max |V| / 448; the fp8
    caches then store K / k_scale and V / v_scale with each layer's own pair, and decode
    close to the model-dtype cache."""
    from graphattn.backends.reference import FP8_MAX

    ref, runner, st = make("cpu", torch.float32)
    hf = runner.forward
    a = runner.add_request("a", list(range(1, 20)))
    runner.step(SchedulerOutput(np.array([a]), np.array([19])))
    want = runner.step(SchedulerOutput(np.array([a]), np.array([1]))).logits[0].clone()
    scales = hf.kv_scales()
    for (k, v), (kc, vc) in zip(scales, hf.caches, strict=True):
        assert k == pytest.approx(float(kc[:-1].abs().max()) / FP8_MAX)
        assert v == pytest.approx(float(vc[:-1].abs().max()) / FP8_MAX)
    assert scales[0] != scales[1]
    with pytest.raises(ValueError, match="kv_scales = .*expected a positive"):
        hf.allocate_caches(4 * st.max_num_blocks_per_req, 8, "fp8_e4m3", scales[:1])
    hf.allocate_caches(4 * st.max_num_blocks_per_req, 8, "fp8_e4m3", scales)
    with pytest.raises(ValueError, match="fp8_scales reads a model-dtype cache"):
        hf.kv_scales()
    st2 = RequestState(4, 64, 8)
    again = GraphRunner(hf, st2, RunnerConfig(policy=BucketPolicy(capture_sizes=(1,))))
    b = again.add_request("a", list(range(1, 20)))
    again.step(SchedulerOutput(np.array([b]), np.array([19])))
    got = again.step(SchedulerOutput(np.array([b]), np.array([1]))).logits[0]
    impls = {hf.impl_for(layer.self_attn, layer.self_attn.scaling)
             for layer in hf.model.model.layers}
    assert {(i.k_scale, i.v_scale) for i in impls} == set(scales)
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)


@pytest.mark.slow
def test_llama_with_an_artifact_folder_loads_or_compiles_with_a_warning(tmp_path, caplog):
    """CompileConfig(artifact_dir=...) around a transformers model: where torch can save the
    compiled layer, a second runner loads it; where it cannot (guards on a class defined
    inside a function, as some transformers modules are), each runner compiles it with a
    warning instead of failing. The tokens are generate()'s either way."""
    from graphattn.artifacts import aot_compile_available

    if not aot_compile_available():
        pytest.skip("this torch does not save compiled functions")
    policy = BucketPolicy(capture_sizes=(1, 2), mixed_token_sizes=(16,))
    loaded = []
    for _ in range(2):
        runners = []
        cfg = CompileConfig(enabled=True, dynamic=True, regions="blocks", artifact_dir=tmp_path)
        with caplog.at_level("WARNING", logger="graphattn.compile"):
            run("cpu", torch.float32, dict(rtol=1e-4, atol=1e-4), cfg, policy, runners)
        loaded.append(runners[0].compiler.num_loaded)
    unsaved = [r for r in caplog.records if "not saved" in r.getMessage()]
    assert loaded == [0, 0] if unsaved else loaded == [0, 1]
    assert len(unsaved) in (0, 2)
