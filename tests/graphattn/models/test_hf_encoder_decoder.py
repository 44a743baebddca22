"""Whisper through HFEncoderDecoder: the encoder once per request, the decoder's own forward
on the paged backend, cross attention over the cached encoder K/V of the cross backend;
token for token equal to the model's own generation, refusals before any state changes."""

import numpy as np
import pytest
import torch

from graphattn import GraphRunner, RunnerConfig
from graphattn.buckets import BucketPolicy
from graphattn.state import RequestState, SchedulerOutput
from graphattn.sync import no_host_sync

transformers = pytest.importorskip("transformers")
MELS, SOURCE = 8, 16


def whisper(device="cpu"):
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(
        vocab_size=128, num_mel_bins=MELS, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, d_model=64, encoder_ffn_dim=96,
        decoder_ffn_dim=96, max_source_positions=SOURCE, max_target_positions=64,
        decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=None,
        init_std=0.2)  # a wider init than the default: fewer repeated tokens
    model = transformers.WhisperForConditionalGeneration(cfg).eval().to(device)
    model.config._attn_implementation = "eager"
    gen = model.generation_config
    gen.eos_token_id = gen.begin_suppress_tokens = gen.suppress_tokens = None
    return model


def own_generation(model, feats, prompt, new):
    """Greedy decoding by transformers' own generation loop (Whisper's generate() adds
    language and timestamp logic a random model has no tokens for; the loop beneath it is
    GenerationMixin.generate)."""
    from transformers.generation import GenerationMixin

    out = GenerationMixin.generate(model, input_features=feats[None],
                                   decoder_input_ids=torch.tensor(prompt)[None].to(feats.device),
                                   max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def runner_of(model, device="cpu"):
    from graphattn.models.hf_encoder_decoder import HFEncoderDecoder

    wrapped = HFEncoderDecoder(model, max_num_reqs=4)
    st = RequestState(4, 64, 8, device)
    wrapped.allocate_caches(4 * st.max_num_blocks_per_req, 8)
    runner = GraphRunner(wrapped, st, RunnerConfig(policy=BucketPolicy(capture_sizes=(4,),
                                                          length_boundaries=(32,))))
    runner.capture(progress=False)
    return runner, st


def decode(runner, st, prompts, feats, new):
    slots = np.array([runner.add_request(f"r{i}", p, encoder_inputs=f)
                      for i, (p, f) in enumerate(zip(prompts, feats, strict=True))], np.int32)
    got = [[] for _ in prompts]
    replayed = 0
    while min(len(g) for g in got) < new:
        left = st.num_prompt_tokens_np[slots] - st.num_computed_tokens_np[slots]
        sched = SchedulerOutput(slots, np.where(left > 0, np.minimum(left, 3), 1))
        with no_host_sync():
            out = runner.step(sched)
        replayed += out.replayed
        tokens = out.sampled_host.wait()
        for j, s in enumerate(slots):
            if st.num_computed_tokens_np[s] >= len(prompts[j]) and len(got[j]) < new:
                got[j].append(int(tokens[j]))
    return got, replayed


def test_whisper_matches_own_generation_with_encoder_run_once():
    model = whisper()
    rng = np.random.default_rng(1)
    prompts = [[1, *rng.integers(2, 128, n).tolist()] for n in (6, 2, 4, 0)]
    feats = [torch.randn(MELS, 2 * SOURCE) for _ in prompts]
    new = 12
    expected = [own_generation(model, f, p, new) for p, f in zip(prompts, feats, strict=True)]
    runner, st = runner_of(model)
    calls = []
    hook = model.model.encoder.register_forward_hook(lambda *a: calls.append(1))
    got, replayed = decode(runner, st, prompts, feats, new)
    hook.remove()
    assert got == expected
    assert len(calls) == len(prompts)  # once per request, never in a step
    assert replayed > 0  # decode steps replayed the captured keys
    # the user's model still works as before
    assert model.config._attn_implementation == "eager"
    assert own_generation(model, feats[0], prompts[0], 3) == expected[0][:3]


def test_encoder_inputs_are_checked_before_the_request_is_admitted():
    runner, st = runner_of(whisper())
    with pytest.raises(ValueError, match=r"encoder-decoder and needs encoder_inputs"):
        runner.add_request("a", [1, 2])
    with pytest.raises(ValueError, match=rf"encoder_inputs must be float input features of "
                                         rf"shape \({MELS}, {2 * SOURCE}\), got shape \(8, 30\)"):
        runner.add_request("a", [1, 2], encoder_inputs=np.zeros((MELS, 30), np.float32))
    assert st.num_active == 0  # nothing was admitted


def test_a_wrapper_with_fewer_slots_than_the_state_is_refused():
    from graphattn.models.hf_encoder_decoder import HFEncoderDecoder

    wrapped = HFEncoderDecoder(whisper(), max_num_reqs=2)
    wrapped.allocate_caches(8, 8)
    with pytest.raises(ValueError, match=r"HFEncoderDecoder holds per-request state for "
                                         r"max_num_reqs = 2 slots, expected >= the state's 4"):
        GraphRunner(wrapped, RequestState(4, 64, 8))


@pytest.mark.parametrize("slots", [2.5, True, 0, "4"])
def test_bad_slot_counts_are_refused(slots):
    from graphattn.models.hf_encoder_decoder import HFEncoderDecoder

    with pytest.raises(ValueError, match="max_num_reqs"):
        HFEncoderDecoder(whisper(), max_num_reqs=slots)


def test_encoder_inputs_that_are_no_features_are_refused():
    runner, st = runner_of(whisper())
    for bad, got in (("features", "str of dtype <U8"), ([[1, 2]], "list of dtype int64")):
        with pytest.raises(ValueError, match=f"encoder_inputs must be float input features .* "
                                             f"got {got}"):
            runner.add_request("a", [1, 2], encoder_inputs=bad)
    assert st.num_active == 0


def test_encoder_inputs_refused_by_a_decoder_only_model():
    from graphattn.models.tiny import TinyConfig, TinyDecoder

    model = TinyDecoder(TinyConfig())
    st = RequestState(2, 32, 8)
    model.allocate_caches(8, 8)
    runner = GraphRunner(model, st)
    with pytest.raises(ValueError, match=r"'a' has encoder_inputs, but the model TinyDecoder "
                                         r"has no encoder"):
        runner.add_request("a", [1, 2], encoder_inputs=np.zeros(3))
    assert st.num_active == 0


def test_unsupported_encoder_decoders_refused_when_wrapping():
    from graphattn.models.hf import HFCausalLM
    from graphattn.models.hf_encoder_decoder import HFEncoderDecoder

    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32))
    with pytest.raises(ValueError, match=r"BartForConditionalGeneration \(model_type 'bart'\) "
                                         r"is not supported by HFEncoderDecoder: its decoder "
                                         r"layers .* are not wired"):
        HFEncoderDecoder(bart, 2)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=16, d_ff=32, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match=r"model_type 't5'\) is not supported by "
                                         r"HFEncoderDecoder: its relative position bias"):
        HFEncoderDecoder(t5, 2)
    with pytest.raises(ValueError, match=r"WhisperForConditionalGeneration .* wrap it with "
                                         r"graphattn.models.hf_encoder_decoder"):
        HFCausalLM(whisper())
    decoder_only = transformers.WhisperForCausalLM(whisper().config)
    with pytest.raises(ValueError, match=r"WhisperForCausalLM \(model_type 'whisper'\) is not "
                                         r"served by HFEncoderDecoder: it serves "
                                         r"WhisperForConditionalGeneration"):
        HFEncoderDecoder(decoder_only, 2)


@pytest.mark.cuda
def test_whisper_under_cuda_graphs_with_no_host_sync():
    """float32 on CUDA: the same tokens as the model's own generation, decode steps
    replayed as graphs with no host sync."""
    model = whisper("cuda")
    rng = np.random.default_rng(2)
    prompts = [[1, *rng.integers(2, 128, n).tolist()] for n in (5, 1, 3, 2)]
    feats = [torch.randn(MELS, 2 * SOURCE, device="cuda") for _ in prompts]
    expected = [own_generation(model, f, p, 8) for p, f in zip(prompts, feats, strict=True)]
    runner, st = runner_of(model, "cuda")
    got, replayed = decode(runner, st, prompts, feats, 8)
    assert got == expected and replayed > 0
