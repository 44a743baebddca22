"""DeepSeek-V2 / V3 (multi-head latent attention) through HFCausalLM on the MLA backend: the
model's own forward, a paged latent cache, absorbed queries; token for token with its own
generate(), chunked prefills of 4 requests, every step under no_host_sync()."""

import copy

import numpy as np
import pytest
import torch

from graphattn import BucketPolicy, GraphRunner, RequestState, RunnerConfig, SchedulerOutput
from graphattn.sync import no_host_sync

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, max_position_embeddings=128, n_routed_experts=4,
              num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
VARIANTS = {
    "v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {}),
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {"n_group": 2, "topk_group": 1}),
    "v3_yarn_qlora": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                      {"n_group": 2, "topk_group": 1, "q_lora_rank": 24, "rope_scaling": YARN}),
}


def build(variant, device="cpu", dtype=torch.float32, **config):
    """The variant's model (`config` overrides its config's fields)."""
    cfg_name, model_name, extra = VARIANTS[variant]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **config})
    ref = getattr(transformers, model_name)(cfg).to(device, dtype).eval()
    ref.config._attn_implementation = "eager"
    ref.generation_config.eos_token_id = None
    return ref


def serve(ref, device, new=20, debug_sync=False, backend="mla", compile=False, runners=None):
    """Each request's greedy tokens through GraphRunner (chunked prefills of 4 tokens;
    `compile`: RunnerConfig's; `runners`: a list that receives the runner)."""
    from graphattn.models.hf import HFCausalLM

    hf = HFCausalLM(copy.deepcopy(ref))
    st = RequestState(4, 64, 8, device)
    hf.allocate_caches(st.num_kv_blocks, 8)
    runner = GraphRunner(hf, st, RunnerConfig(policy=BucketPolicy(
        capture_sizes=(1, 2, 4), length_boundaries=(64,), mixed_token_sizes=(16,)),
        compile=compile))
    assert runner.backend == backend
    if runners is not None:
        runners.append(runner)
    runner.capture(progress=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n) for n in (5, 11, 3, 7)]
    for i, p in enumerate(prompts):
        runner.add_request(f"r{i}", p)
    got, slots = [[] for _ in prompts], np.arange(4)
    while min(len(g) for g in got) < new:
        left = st.num_prompt_tokens_np[:4] - st.num_computed_tokens_np[:4]
        sched = SchedulerOutput(slots, np.where(left > 0, np.minimum(left, 4), 1))
        if debug_sync:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with no_host_sync():
                out = runner.step(sched)
        finally:
            if debug_sync:
                torch.cuda.set_sync_debug_mode(0)
        tokens = out.sampled_host.wait()
        for j in range(4):
            if st.num_computed_tokens_np[j] >= len(prompts[j]) and len(got[j]) < new:
                got[j].append(int(tokens[j]))
    return prompts, got


def expected(ref, prompts, device, new=20):
    return [ref.generate(torch.tensor(p, device=device)[None], max_new_tokens=new,
                         do_sample=False)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_deepseek_matches_its_own_generate_on_the_mla_backend(variant):
    ref = build(variant)
    prompts, got = serve(ref, "cpu")
    assert got == expected(ref, prompts, "cpu")


def test_compiled_deepseek_shares_one_dynamic_compile_past_batch_1():
    """CompileConfig(dynamic=True): the decode keys of 2 and 4 rows and the mixed key share
    one compiled step (the wrapper's calls leave nothing for a later call to guard on);
    batch 1 compiles apart (transformers' own ``expand_kv`` copies a slice, which
    specializes one token), and the tokens are the model's own generate()'s."""
    from graphattn import CompileConfig

    ref, runners = build("v3"), []
    prompts, got = serve(ref, "cpu", new=6, runners=runners, compile=CompileConfig(
        enabled=True, dynamic=True, backend="eager"))
    assert got == expected(ref, prompts, "cpu", new=6)
    assert runners[0].compiler.num_compiles == 2


def regional_compiles(build_model, backend):
    """Compiles of a dynamic regions="blocks" step of the model with 2 and with 3 decoder
    layers (the first dense, the others MoE), each checked against its generate()."""
    from graphattn import CompileConfig

    counts = []
    for layers in (2, 3):
        ref, runners = build_model(num_hidden_layers=layers), []
        prompts, got = serve(ref, "cpu", new=6, runners=runners, backend=backend,
                             compile=CompileConfig(enabled=True, dynamic=True,
                                                   regions="blocks", backend="eager"))
        assert got == expected(ref, prompts, "cpu", new=6)
        counts.append(runners[0].compiler.num_compiles)
    return counts


def test_regional_compile_of_deepseek_compiles_per_layer_kind_not_per_layer():
    """CompileConfig(regions="blocks"): each layer's latent is recorded into one slot and its
    cache read from its own module (no layer index for dynamo to specialize), so a third
    layer of a kind already seen (MoE) adds no compile: the dense and the MoE layer, each
    with batch 1 apart (transformers' expand_kv), 4 in all."""
    assert regional_compiles(lambda **c: build("v3", **c), "mla") == [4, 4]


def test_deepseek_leaves_the_users_model_as_it_was():
    from graphattn.models.hf import HFCausalLM

    ref = build("v3")
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    before = ref(ids).logits
    hf = HFCausalLM(ref)
    assert hf.backends == ("mla",)
    torch.testing.assert_close(ref(ids).logits, before, rtol=0, atol=0)
    assert hf.latent._latent is None  # the user's forward recorded nothing


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_deepseek_under_cuda_graphs_with_no_host_sync(variant):
    ref = build(variant, "cuda")
    prompts, got = serve(ref, "cuda", debug_sync=True)
    assert got == expected(ref, prompts, "cuda")


def test_latent_cache_refuses_fp8():
    from graphattn.models.hf import HFCausalLM

    hf = HFCausalLM(build("v2"))
    with pytest.raises(ValueError, match="latent .MLA. cache of DeepseekV2ForCausalLM takes "
                                         "the model's dtype only"):
        hf.allocate_caches(8, 8, "fp8_e4m3")
