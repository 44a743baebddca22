"""bench.fp8_kv.agreement: two runs' greedy tokens compared (bench.real_agreement too)."""

import numpy as np

from bench.fp8_kv import agreement


def test_agreement_counts_equal_positions_and_each_requests_first_difference():
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    b = np.array([[1, 2, 9, 4], [5, 6, 7, 8]])
    got = agreement(a, b)
    assert got["greedy_agreement"] == 7 / 8
    assert got["first_difference"] == [2, 4]
