"""NgramProposer against a per-row Python reference, on fresh random histories; fixed
shapes (meta), no host reads."""

import numpy as np
import pytest
import torch

from graphattn.proposer import DraftProposer, NgramProposer
from graphattn.sync import no_host_sync


def reference(tokens: list[int], last: int, n: int, window: int, k: int) -> list[int]:
    lo = max(0, last - window + 1)
    tail = tokens[last - n + 1: last + 1]
    for end in range(last - 1, lo + n - 2, -1):  # latest earlier occurrence first
        if end - n + 1 >= lo and tokens[end - n + 1: end + 1] == tail:
            return [tokens[min(end + 1 + i, last)] for i in range(k)]
    return [tokens[last]] * k


@pytest.mark.parametrize(("n", "window", "vocab"), [(1, 16, 4), (2, 12, 3), (3, 40, 5)])
def test_ngram_proposer_matches_reference(n, window, vocab):
    rng = np.random.default_rng(n)
    rows, length, k = 6, 60, 3
    tokens = torch.from_numpy(rng.integers(0, vocab, (rows + 2, length))).long()
    slots = torch.from_numpy(rng.permutation(rows + 2)[:rows]).long()
    last = torch.from_numpy(rng.integers(n, length, rows)).long()
    p = NgramProposer(n, window)
    assert isinstance(p, DraftProposer)
    with no_host_sync():
        got = p.propose(tokens, slots, last, k)
    want = [reference(tokens[s].tolist(), int(e), n, window, k) for s, e in zip(slots, last,
                                                                                strict=True)]
    assert got.tolist() == want
    meta = p.propose(tokens.to("meta"), slots.to("meta"), last.to("meta"), k)
    assert meta.shape == (rows, k) and meta.dtype == torch.int64


def test_ngram_proposer_refuses_bad_sizes():
    with pytest.raises(ValueError, match=r"1 <= n < window, got n = 8, window = 8"):
        NgramProposer(8, 8)
