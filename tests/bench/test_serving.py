"""`bench.serving`: spec decoding with the oracle drafter and the n-gram proposer inside the
step give plain greedy decoding's tokens, with no host sync inside a step."""

import torch

from bench.serving import _workload, serve
from graphattn.models.tiny import TinyConfig, TinyDecoder


def test_spec_rows_serve_the_plain_rows_tokens():
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=128, hidden_size=32))
    work = [(p[:40], n) for p, n in _workload(6, 128)]
    plain_row, plain = serve(model, "cpu", work, "graphs", 0, None, max_reqs=4)
    assert plain_row["tokens"] == sum(n for _, n in work) and plain_row["syncs_per_step"] == 0
    oracle = {i: [work[i][0][-1]] + v for i, v in plain.items()}
    spec_row, spec = serve(model, "cpu", work, "graphs", 3, oracle, max_reqs=4)
    assert spec == plain and spec_row["accept_rate"] == 1.0
    assert spec_row["steps"] < plain_row["steps"]
    ngram_row, ngram = serve(model, "cpu", work, "eager", 3, None, max_reqs=4, ngram=True)
    assert ngram == plain and ngram_row["mode"] == "eager+ngram"
