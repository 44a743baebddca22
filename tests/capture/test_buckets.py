import numpy as np
import pytest

from graphattn.buckets import (
    LengthBuckets,
    PaddingStats,
    default_capture_sizes,
    pad_to_capture_size,
    validate_sizes,
)


def test_default_capture_sizes():
    assert default_capture_sizes(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert default_capture_sizes(3) == (1, 2, 3)
    assert default_capture_sizes(20)[-1] == 20
    with pytest.raises(ValueError, match="max_size = 0"):
        default_capture_sizes(0)


@pytest.mark.parametrize("sizes, match", [
    ([], "must not be empty"), ([0, 1], r"capture_sizes\[0\] = 0, expected in \[1, "),
    ([2, 1], "sorted and unique"), ([1, 1], "sorted and unique"),
    ([1.5], r"capture_sizes\[0\] must be an integer, got 1.5"),
    ([1, 10**12], r"capture_sizes\[1\] = 1000000000000, expected in \[1, 1048576\]")])
def test_validate_sizes(sizes, match):
    with pytest.raises(ValueError, match=match):
        validate_sizes("capture_sizes", sizes)


def test_pad_to_capture_size():
    sizes = (1, 2, 4, 8)
    assert [pad_to_capture_size(n, sizes) for n in (0, 1, 3, 8)] == [1, 1, 4, 8]
    assert pad_to_capture_size(9, sizes) is None  # one past the largest: eager
    with pytest.raises(ValueError, match="n = -1"):
        pad_to_capture_size(-1, sizes)


def test_length_buckets_powers_of_two_capped():
    lb = LengthBuckets(100)
    assert lb.boundaries == (16, 32, 64, 100)
    assert [lb.bucket(n) for n in (0, 1, 16, 17, 64, 65, 100)] == [16, 16, 16, 32, 64, 100, 100]
    assert lb.buckets_of(np.array([3, 33, 99])).tolist() == [16, 64, 100]
    with pytest.raises(ValueError, match=r"max_len = 101, expected in \[0, 100\]"):
        lb.bucket(101)
    with pytest.raises(ValueError, match="lengths must be in"):
        lb.buckets_of(np.array([101]))


def test_length_buckets_user_list():
    assert LengthBuckets(64, (8, 24, 200)).boundaries == (8, 24, 64)
    with pytest.raises(ValueError, match="sorted and unique"):
        LengthBuckets(64, (24, 8))
    with pytest.raises(ValueError, match="max_model_len = 0"):
        LengthBuckets(0)


def test_padding_stats():
    s = PaddingStats()
    s.record(3, 4, 3, 4, 10, 16)
    s.record(4, 4, 4, 4, 16, 16)
    assert s.token_waste == pytest.approx(1 / 8)
    assert s.length_waste == pytest.approx(1 - 26 / 32)
    with pytest.raises(ValueError, match="below real"):
        s.record(5, 4, 5, 5)
    assert PaddingStats().token_waste == 0.0


def test_pad_to_capture_size_refuses_unsorted_and_fractional_input():
    with pytest.raises(ValueError, match=r"capture_sizes must be sorted ascending and unique, "
                                         r"got \[8, 2\]"):
        pad_to_capture_size(3, (8, 2))
    with pytest.raises(ValueError, match="n must be an integer, got 2.5"):
        pad_to_capture_size(2.5, (1, 4))
