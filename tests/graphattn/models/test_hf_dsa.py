"""DeepSeek-V3.2 (latent attention + the lightning indexer's top-k) through HFCausalLM on the
sparse-indexer backend: the model's own forward, paged latent and index caches, the top-k
selection on the device; token for token with its own generate() (chunked prefills of 4
requests, selections narrower than the sequences), every step under no_host_sync()."""

import pytest
import torch

from tests.graphattn.models.test_hf_mla import COMMON, YARN, expected, regional_compiles, serve

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV32ForCausalLM"):
    pytest.skip("this transformers has no DeepSeek-V3.2", allow_module_level=True)

DSA = dict(n_group=2, topk_group=1, q_lora_rank=24, index_n_heads=16, index_head_dim=16)
VARIANTS = {
    "topk6": {**DSA, "index_topk": 6},
    "topk3_yarn": {**DSA, "index_topk": 3, "rope_scaling": YARN},
    "topk64": {**DSA, "index_topk": 64},  # wider than every sequence: dense
}


def build(variant, device="cpu", dtype=torch.float32, **config):
    """The variant's model (`config` overrides its config's fields)."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV32Config(**{**COMMON, **VARIANTS[variant], **config})
    ref = transformers.DeepseekV32ForCausalLM(cfg).to(device, dtype).eval()
    ref.config._attn_implementation = "eager"
    ref.generation_config.eos_token_id = None
    return ref


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_deepseek_v32_matches_its_own_generate_on_the_sparse_indexer_backend(variant):
    ref = build(variant)
    prompts, got = serve(ref, "cpu", backend="sparse_indexer")
    assert got == expected(ref, prompts, "cpu")


def test_deepseek_v32_compiled_step_matches_too():
    """RunnerConfig(compile=...): dynamo traces the model's forward with the indexer's
    forward swapped in (whole graph, no break), the same tokens."""
    from graphattn import CompileConfig

    ref = build("topk6")
    prompts, got = serve(ref, "cpu", new=12, backend="sparse_indexer",
                         compile=CompileConfig(enabled=True, backend="eager"))
    assert got == expected(ref, prompts, "cpu", new=12)


def test_regional_compile_of_deepseek_v32_adds_no_compile_per_layer():
    """CompileConfig(regions="blocks"): every indexer's forward is one function bound to it,
    reading its index cache from its own module, so a third layer of a kind already seen
    (MoE) adds no compile."""
    counts = regional_compiles(lambda **c: build("topk6", **c), "sparse_indexer")
    assert counts[0] == counts[1]


def test_the_selection_is_what_decides_the_tokens():
    """A narrow top-k gives other tokens than a dense one (so the match above tests it)."""
    narrow, dense = build("topk3_yarn"), build("topk3_yarn")
    dense.config.index_topk = 64
    for layer in dense.model.layers:
        layer.self_attn.indexer.index_topk = 64
    prompts, got = serve(narrow, "cpu", backend="sparse_indexer")
    assert got != expected(dense, prompts, "cpu")


def test_deepseek_v32_leaves_the_users_model_as_it_was():
    from graphattn.models.hf import HFCausalLM

    ref = build("topk6")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    before = ref(ids).logits
    hf = HFCausalLM(ref)
    assert hf.backends == ("sparse_indexer",)
    torch.testing.assert_close(ref(ids).logits, before, rtol=0, atol=0)
    assert hf.latent._latent is None


def test_an_indexer_it_cannot_rebuild_is_refused_when_wrapping():
    from graphattn.models.hf import HFCausalLM

    ref = build("topk6")
    del ref.model.layers[1].self_attn.indexer.k_norm
    with pytest.raises(ValueError, match="indexer DeepseekV32Indexer lacks k_norm"):
        HFCausalLM(ref)


@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_deepseek_v32_under_cuda_graphs_with_no_host_sync(compiled):
    """The indexer's scores from its Triton kernel, the attention over the selection from
    the unified kernel; eager-model graphs, and inductor-compiled ones."""
    ref = build("topk6", "cuda")
    prompts, got = serve(ref, "cuda", debug_sync=True, backend="sparse_indexer",
                         compile=compiled)
    assert got == expected(ref, prompts, "cuda")
