import pytest
import torch

from graphattn.sampling import SamplingParams, SamplingTable, hash_uniform
from graphattn.sync import no_host_sync


def test_params_validated():
    for kw, match in [({"temperature": -1.0}, "temperature = -1.0"), ({"top_k": -2}, "top_k"),
                      ({"top_p": 0.0}, r"top_p = 0.0, expected a float in \(0, 1\]"),
                      ({"seed": 1.5}, "seed must be an integer")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)


def test_hash_uniform_is_deterministic_and_uniform():
    seed = torch.tensor([[3], [4]])
    u = hash_uniform(seed, torch.tensor([[7], [7]]), torch.arange(50000)[None])
    assert torch.equal(u, hash_uniform(seed, torch.tensor([[7], [7]]), torch.arange(50000)[None]))
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.std().item() - 12 ** -0.5) < 0.01
    assert (u[0] != u[1]).float().mean() > 0.99


def sample_many(params, logits, n=4000):
    table = SamplingTable(n, "cpu")
    for i in range(n):
        table.set(i, SamplingParams(**{**params, "seed": i}))
    slots = torch.arange(n)
    with no_host_sync():
        tokens, logprobs = table.sample(logits.expand(n, -1), slots, torch.full((n,), 5))
    return tokens, logprobs


def test_sampling_follows_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    tokens, logprobs = sample_many({"temperature": 0.7}, logits)
    freq = torch.bincount(tokens, minlength=6).double() / tokens.numel()
    want = torch.softmax(logits[0].double() / 0.7, -1)
    assert (freq - want).abs().max() < 0.03
    torch.testing.assert_close(logprobs, torch.log_softmax(logits[0], -1)[tokens])
    tokens, _ = sample_many({"temperature": 1.0, "top_k": 2}, logits)
    assert set(tokens.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # 0.55, 0.20, 0.12, ...: top_p 0.8 keeps 3 tokens
    assert probs[:2].sum() < 0.8 <= probs[:3].sum()
    tokens, _ = sample_many({"temperature": 1.0, "top_p": 0.8}, logits)
    assert set(tokens.tolist()) == {0, 1, 2}


def test_greedy_and_sampled_rows_mix_in_one_call():
    table = SamplingTable(3, "cpu")
    table.set(1, SamplingParams(temperature=5.0, seed=1))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    tokens, _ = table.sample(logits, torch.tensor([0, 1, 2]), torch.tensor([4, 4, 4]))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    again, _ = table.sample(logits, torch.tensor([0, 1, 2]), torch.tensor([4, 4, 4]))
    assert torch.equal(tokens, again)  # seeded: the same draw for the same position
