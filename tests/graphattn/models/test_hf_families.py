"""Families through HFCausalLM: token for token equal to each model's own generate() (tiny
random configs, chunked prefill), or refused when wrapping with the class and the reason."""

import numpy as np
import pytest
import torch

from graphattn import GraphRunner, RunnerConfig
from graphattn.buckets import BucketPolicy
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import no_host_sync
from tests.helpers import serve_greedy

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral_window8": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 12.0,
                                                         "logits_scaling": 8.0,
                                                         "residual_multiplier": 0.2,
                                                         "attention_multiplier": 0.05}),
    # multi-head families: SMALL's num_key_value_heads would be stored, not used
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"num_key_value_heads": 4}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"num_key_value_heads": 4}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"num_local_experts": 4, "head_dim": 16,
                                                      "sliding_window": 8}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4,
                                                           "moe_intermediate_size": 32,
                                                           "shared_expert_intermediate_size": 32}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "head_dim": 16,
                                                           "moe_intermediate_size": 32,
                                                           "num_experts_per_tok": 2}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", {"num_local_experts": 4}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "phi": ("PhiConfig", "PhiForCausalLM", {"num_key_value_heads": 4}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "starcoder2_window8": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": 8}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {"n_embd": 64, "n_layer": 2, "n_head": 4,
                                               "rotary_dim": 8, "num_key_value_heads": 4}),
}


def build(cfg_name, model_name, extra):
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**{**SMALL, **extra})
    model = getattr(transformers, model_name)(cfg).eval()
    model.config._attn_implementation = "eager"
    # greedy through EOS too (min_new_tokens would mask EOS logits, which the runner keeps)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# small settings for the config fields that some families have
GENERIC_EXTRA = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
                 "moe_intermediate_size": 32, "num_experts_per_tok": 2, "head_dim": 16,
                 "shared_expert_intermediate_size": 32, "moe_num_experts": 4, "pad_token_id": 0,
                 "sliding_window": 8}
# fields a family's default config leaves None although its forward needs them
TYPE_EXTRA = {"dots1": {"n_shared_experts": 1}, "dots3_note_text": {"num_key_value_heads": 4}}


def build_generic(model_type):
    """Any causal-LM family of the installed transformers in a tiny random config."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    defaults = CONFIG_MAPPING[model_type]()
    extra = {k: v for k, v in GENERIC_EXTRA.items() if hasattr(defaults, k)}
    cfg = CONFIG_MAPPING[model_type](**{**SMALL, **extra, **TYPE_EXTRA.get(model_type, {})})
    torch.manual_seed(0)
    model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])(cfg).eval()
    model.config._attn_implementation = "eager"
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def serve_and_compare(model, unchecked=False, new=20):
    """Greedy tokens and logits of 4 chunk-prefilled requests (one of 40 tokens) batched
    through HFCausalLM, against each one's own generate() alone; returns (ours,
    generate()'s, max logit difference)."""
    from graphattn.models.hf import HFCausalLM

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128, n) for n in (13, 5, 9, 40)]  # batched with a long one
    ref = [model.generate(torch.tensor(p)[None], max_new_tokens=new, do_sample=False,
                          output_logits=True, return_dict_in_generate=True) for p in prompts]
    hf = HFCausalLM(model, unchecked=unchecked)  # the user's model itself, no copy
    st = RequestState(4, 64, 8)
    hf.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    runner = GraphRunner(hf, st, RunnerConfig(policy=BucketPolicy(capture_sizes=(4,),
                                                     length_boundaries=(32,))))
    runner.capture(progress=False)
    diff = [0.0]

    def compare(j, out, k):
        diff[0] = max(diff[0], float((out.logits[j] - ref[j].logits[k][0]).abs().max()))

    got = serve_greedy(runner, prompts, new, 6, compare)
    expected = [r.sequences[0, len(p):].tolist() for r, p in zip(ref, prompts, strict=True)]
    return got, expected, diff[0]


def _swept():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from graphattn.models.hf import SWEPT

    return [t for t in SWEPT if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]


@pytest.mark.parametrize("model_type", _swept())
def test_swept_family_matches_own_generate(model_type):
    """The families accepted from the sweep, in its generic tiny config (windows of 8)."""
    got, expected, diff = serve_and_compare(build_generic(model_type), new=10)
    assert got == expected and diff < 1e-4, diff


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_own_generate(family):
    model = build(*FAMILIES[family])
    got, expected, diff = serve_and_compare(model)
    assert got == expected and diff < 1e-4, diff
    # the user's model still works as before
    p = np.random.default_rng(1).integers(0, 128, 13)
    again = model.generate(torch.tensor(p)[None], max_new_tokens=3, do_sample=False)
    assert again[0, 13:].tolist() == expected[0][:3]


REFUSED = {
    "GPTNeoForCausalLM": ("GPTNeoConfig", {"num_layers": 2, "num_heads": 4, "window_size": 8,
                                           "attention_types": [[["global", "local"], 1]]},
                          "local-attention layers"),
    "StableLmForCausalLM": ("StableLmConfig", {}, "not among the families checked"),
    "BartForCausalLM": ("BartConfig", {"d_model": 64, "encoder_attention_heads": 4,
                                       "decoder_attention_heads": 4}, "encoder-decoder"),
    # heads other than the causal LM's, of an accepted family
    "LlamaModel": ("LlamaConfig", {}, "not a causal-LM head: .* serves LlamaForCausalLM"),
    "LlamaForSequenceClassification": ("LlamaConfig", {}, "not a causal-LM head"),
    "LlamaForTokenClassification": ("LlamaConfig", {}, "not a causal-LM head"),
    "MambaForCausalLM": ("MambaConfig", {"num_hidden_layers": 1},
                         "keep a recurrent state, not a KV cache"),
    "DeepseekV4ForCausalLM": ("DeepseekV4Config", {}, "compressed sparse attention"),
}


@pytest.mark.parametrize("model_name", sorted(REFUSED))
def test_unsupported_families_refused_when_wrapping(model_name):
    from graphattn.models.hf import HFCausalLM

    cfg_name, extra, reason = REFUSED[model_name]
    cfg = getattr(transformers, cfg_name)(**{**SMALL, **extra})
    model = getattr(transformers, model_name)(cfg)
    with pytest.raises(ValueError, match=rf"{model_name} \(model_type .*{reason}"):
        HFCausalLM(model)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_family_under_cuda_graphs_with_no_host_sync(family):
    """Our greedy tokens under CUDA graphs, teacher-forced through the model's own full
    forward: every step's logits agree (tokens can flip on near-ties under TF32)."""
    from graphattn.models.hf import HFCausalLM

    model = build(*FAMILIES[family]).to("cuda")
    hf = HFCausalLM(model)
    st = RequestState(4, 64, 8, "cuda")
    hf.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    runner = GraphRunner(hf, st, RunnerConfig(policy=BucketPolicy(capture_sizes=(4,),
                                                                 length_boundaries=(32,))))
    report = runner.capture(progress=False)
    assert report.num_graphs > 0
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128, n).tolist() for n in (13, 5, 9, 3)]
    slots = np.array([runner.add_request(f"r{i}", p) for i, p in enumerate(prompts)], np.int32)
    seqs = [list(p) for p in prompts]
    logits = [[] for _ in prompts]
    replayed = 0
    for _ in range(16):
        left = st.num_prompt_tokens_np[slots] - st.num_computed_tokens_np[slots]
        sched = SchedulerOutput(slots, np.where(left > 0, np.minimum(left, 6), 1))
        with no_host_sync():
            out = runner.step(sched)
        replayed += out.replayed
        for j, s in enumerate(slots):
            if st.num_computed_tokens_np[s] >= len(prompts[j]):
                logits[j].append(out.logits[j].float().cpu())
                seqs[j].append(int(out.sampled[j]))
    assert replayed >= 8
    for j, seq in enumerate(seqs):
        with torch.no_grad():
            ref = model(torch.tensor(seq[:-1], device="cuda")[None]).logits[0].float().cpu()
        got = torch.stack(logits[j])
        torch.testing.assert_close(got, ref[len(prompts[j]) - 1:], rtol=2e-2, atol=2e-2)


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64}
REFUSED_CONFIGS = {
    "llama_dynamic": ("LlamaConfig", "LlamaForCausalLM",
                      {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
                      "rope_type 'dynamic'"),
    "llama_longrope": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": LONGROPE},
                       "rope_type 'longrope'"),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM",
                      {"rope_scaling": LONGROPE, "pad_token_id": 0}, "rope_type 'longrope'"),
    "qwen2_moe_window": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                         {"num_experts": 4, "use_sliding_window": True, "sliding_window": 8},
                         "applied only through the attention mask"),
    "phimoe_window": ("PhimoeConfig", "PhimoeForCausalLM",
                      {"num_local_experts": 4, "sliding_window": 8},
                      "applied only through the attention mask"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_CONFIGS))
def test_configs_that_would_run_wrong_are_refused_when_wrapping(case):
    """Accepted families, in configs whose windows or rope factors would come out wrong."""
    from graphattn.models.hf import HFCausalLM

    cfg_name, model_name, extra, reason = REFUSED_CONFIGS[case]
    cfg = getattr(transformers, cfg_name)(**{**SMALL, **extra})
    with pytest.raises(ValueError, match=rf"not supported with this config: .*{reason}"):
        HFCausalLM(getattr(transformers, model_name)(cfg))
