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


def test_rejection_sample_keeps_the_target_distribution():
    """Drafts drawn from q, kept with min(1, p/q), else drawn from max(0, p - q): the output
    follows p (200,000 draws on a 6-token vocabulary, fresh random p and q)."""
    from graphattn.sampling import rejection_sample

    gen = torch.Generator().manual_seed(0)
    n, v = 200_000, 6
    p = torch.softmax(2 * torch.randn(v, generator=gen), -1)
    q = torch.softmax(2 * torch.randn(v, generator=gen), -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    with no_host_sync():
        accepted, tokens = rejection_sample(
            p.expand(n, v), q.expand(n, v), drafts, torch.rand(n, generator=gen),
            torch.rand(n, v, generator=gen).clamp(1e-12, 1 - 1e-12))
    freq = torch.bincount(tokens, minlength=v).double() / n
    assert (freq - p.double()).abs().max() < 0.005
    assert abs(accepted.double().mean() - torch.minimum(p, q).sum()) < 0.005
    assert torch.equal(tokens[accepted], drafts[accepted])
    same, _ = rejection_sample(p.expand(4, v), p.expand(4, v), drafts[:4], torch.rand(4),
                               torch.rand(4, v))
    assert same.all()  # q = p: every draft kept


def test_probs_is_the_sampling_distribution():
    table = SamplingTable(3, "cpu")
    table.set(1, SamplingParams(temperature=0.7, top_k=3))
    table.set(2, SamplingParams(temperature=1.0, top_p=0.8))
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(3, -1)
    with no_host_sync():
        p = table.probs(logits, torch.arange(3))
    assert p[0].tolist() == [1, 0, 0, 0, 0, 0]  # greedy: the argmax
    top3 = torch.softmax(logits[0, :3] / 0.7, -1)
    torch.testing.assert_close(p[1], torch.cat([top3, torch.zeros(3)]))
    top_p = torch.softmax(logits[0, :3], -1)  # 0.55, 0.20, 0.12 of the full: 3 kept
    torch.testing.assert_close(p[2], torch.cat([top_p, torch.zeros(3)]))


@pytest.mark.parametrize("vocab", [100, 16384, 32000, 128256, 50257, 16411])
def test_greedy_tokens_are_argmax_with_ties_and_nans(vocab):
    from graphattn.sampling import _argmax_chunk, greedy_tokens

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1] = 0.0  # every entry tied: the first
    x[2, vocab // 3] = x[2, vocab - 1] = x[2].max() + 1  # tied in two chunks: the first
    x[3, vocab - 2] = float("nan")  # a NaN wins
    x[4, 5] = x[4, vocab // 2] = float("nan")  # the first NaN
    x[5] = torch.arange(vocab, dtype=torch.float32).flip(0)  # the maximum at 0
    with no_host_sync():
        got = greedy_tokens(x)
    assert got.tolist() == x.argmax(-1).tolist()
    c = _argmax_chunk(vocab)
    assert c == 0 or (vocab % c == 0 and 32 <= vocab // c <= 512 and c >= 256)
    assert greedy_tokens(x.to(torch.bfloat16)).tolist() == x.to(torch.bfloat16).argmax(
        -1).tolist()
