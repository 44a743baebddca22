"""Fused sibling projections (graphattn.models.projections): the model's own forward with
q / k / v and gate / up as one matmul each, through the runner eager and compiled, against
the unfused model's generate()."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphattn import BucketPolicy, CompileConfig
from graphattn.models.projections import (
    FusedLinear,
    fuse_projections,
    unfuse_projections,
)
from tests.graphattn.models.test_hf import run

transformers = pytest.importorskip("transformers")


def llama(bias=False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, attention_bias=bias)
    return transformers.LlamaForCausalLM(cfg).eval()


class MatmulCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm,
                                   torch.ops.aten.bmm, torch.ops.aten.linear):
            self.count += 1
        return func(*args, **(kwargs or {}))


def matmuls(model, ids):
    with torch.no_grad(), MatmulCount() as mode:
        logits = model(ids).logits
    return mode.count, logits


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_give_the_models_logits_with_fewer_matmuls(bias):
    """Per layer q / k / v and gate / up run as 2 matmuls instead of 5 (o and down stay),
    the logits as the plain model's (float32), biases included."""
    ref = llama(bias)
    fused = copy.deepcopy(ref)
    assert fuse_projections(fused) == 4
    ids = torch.randint(0, 256, (1, 9))
    plain_n, want = matmuls(ref, ids)
    fused_n, got = matmuls(fused, ids)
    assert plain_n - fused_n == 2 * 3  # 2 layers, 3 launches saved in each
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    attn = fused.model.layers[0].self_attn
    assert type(attn.k_proj) is FusedLinear and attn.k_proj.group.input is None
    # the weights are views of one tensor, with the plain model's values
    assert attn.k_proj.weight.untyped_storage().data_ptr() == \
        attn.q_proj.weight.untyped_storage().data_ptr()
    torch.testing.assert_close(attn.v_proj.weight, ref.model.layers[0].self_attn.v_proj.weight,
                               rtol=0, atol=0)


def test_a_sibling_called_with_another_input_computes_its_own():
    """The slices are handed out only for the same input tensor; another input (or a
    sibling called twice) computes the group again."""
    ref = llama()
    fused = copy.deepcopy(ref)
    fuse_projections(fused)
    plain, attn = ref.model.layers[1].self_attn, fused.model.layers[1].self_attn
    x, y = torch.randn(3, 64), torch.randn(3, 64)
    with torch.no_grad():
        got = [attn.q_proj(x), attn.k_proj(y), attn.k_proj(y), attn.v_proj(x)]
        want = [plain.q_proj(x), plain.k_proj(y), plain.k_proj(y), plain.v_proj(x)]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_unfuse_gives_back_plain_layers_with_weights_of_their_own():
    ref = llama(bias=True)
    fused = copy.deepcopy(ref)
    fuse_projections(fused)
    assert unfuse_projections(fused) == 10
    attn = fused.model.layers[0].self_attn
    assert type(attn.q_proj) is torch.nn.Linear and not hasattr(attn.q_proj, "group")
    assert attn.k_proj.weight.untyped_storage().data_ptr() != \
        attn.q_proj.weight.untyped_storage().data_ptr()
    for (name, a), (_, b) in zip(ref.state_dict().items(), fused.state_dict().items(),
                                 strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_layers_that_differ_stay_unfused():
    """Siblings of other input widths, dtypes or bias use are left as they are."""
    ref = llama()
    attn = ref.model.layers[0].self_attn
    attn.k_proj = torch.nn.Linear(64, 32, bias=True)
    ref.model.layers[1].mlp.up_proj.half()
    assert fuse_projections(ref) == 2
    assert type(attn.q_proj) is torch.nn.Linear
    assert type(ref.model.layers[1].mlp.up_proj) is torch.nn.Linear


def test_fusing_a_meta_model_allocates_nothing():
    with torch.device("meta"):
        model = llama()
    assert fuse_projections(model) == 4
    assert model.model.layers[0].mlp.gate_proj.weight.is_meta


@pytest.mark.parametrize("compile", [False, "dynamic", "blocks"])
def test_fused_llama_through_the_runner_matches_its_own_generate(compile):
    """The fused model through HFCausalLM and GraphRunner, eager or compiled (dynamic
    shapes; regions "blocks": one compiled layer for both), against the unfused model's
    generate(); the compiled step compiles once (the group's handed-out slices leave it
    nothing to guard on at its next call)."""
    cfg = False if not compile else CompileConfig(
        enabled=True, dynamic=True, backend="eager",
        regions="blocks" if compile == "blocks" else "step")
    runners = []
    policy = BucketPolicy(capture_sizes=(1, 2, 4), mixed_token_sizes=(16,))
    run("cpu", torch.float32, dict(rtol=1e-4, atol=1e-4), cfg, policy, runners,
        prepare=fuse_projections)
    if compile:
        assert runners[0].compiler.num_compiles == 1


@pytest.mark.cuda
def test_fused_llama_under_cuda_graphs_matches_its_own_generate():
    torch.cuda.set_sync_debug_mode(0)
    report, keys = run("cuda", torch.float32, dict(rtol=2e-3, atol=2e-3),
                       CompileConfig(enabled=True), prepare=fuse_projections)
    assert report.num_graphs > 0 and sum(k is not None for k in keys) >= 6
