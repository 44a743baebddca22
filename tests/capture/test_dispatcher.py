import pytest

from graphattn.buckets import BucketPolicy, LengthBuckets, default_capture_sizes
from graphattn.capture.dispatcher import GraphDispatcher
from graphattn.keys import CaptureSupport, GraphKey
from graphattn.sync import no_host_sync


def disp(**kw):
    args = dict(capture_sizes=[1, 2, 4, 8], length_buckets=LengthBuckets(128), decode_query_len=1,
                mixed_token_sizes=[16, 32])
    args.update(kw)
    return GraphDispatcher(**args)


def test_uniform_decode_keys():
    d = disp()
    with no_host_sync():
        assert d.dispatch(3, 3, 40, True) == GraphKey(4, 4, 64, True)
        assert d.dispatch(8, 8, 128, True) == GraphKey(8, 8, 128, True)  # largest size
        assert d.dispatch(0, 0, 0, True) == GraphKey(1, 1, 16, True)  # empty / dummy
        assert d.dispatch(9, 9, 5, True) == GraphKey(16, 16, 16, False)  # one past: mixed key
    assert d.dispatch(33, 33, 5, True) is None  # beyond everything: eager


def test_spec_decode_keys_and_mixed():
    d = disp(decode_query_len=3)
    assert d.dispatch(3, 9, 20, True) == GraphKey(4, 12, 32, True)
    assert d.dispatch(3, 10, 20, False) == GraphKey(16, 16, 32, False)
    assert d.dispatch(3, 40, 20, False) is None
    with pytest.raises(ValueError, match="must have 9 tokens, got 8"):
        d.dispatch(3, 8, 20, True)
    with pytest.raises(ValueError, match="max_len = 200"):
        d.dispatch(1, 3, 200, True)
    with pytest.raises(ValueError, match="0 <= num_reqs <= num_tokens"):
        d.dispatch(4, 3, 20, False)


@pytest.mark.parametrize("support, q, uniform_ok, mixed_ok", [
    (CaptureSupport.ALWAYS, 2, True, True),
    (CaptureSupport.UNIFORM_BATCH, 2, True, False),
    (CaptureSupport.UNIFORM_SINGLE_TOKEN_DECODE, 1, True, False),
    (CaptureSupport.UNIFORM_SINGLE_TOKEN_DECODE, 2, False, False),
    (CaptureSupport.NEVER, 1, False, False),
])
def test_capture_support_is_honoured(support, q, uniform_ok, mixed_ok):
    d = disp(decode_query_len=q, capture_support=support)
    assert (d.dispatch(2, 2 * q, 10, True) is not None) == uniform_ok
    assert (d.dispatch(2, 5, 10, False) is not None) == mixed_ok
    keys = d.all_keys()
    assert any(k.uniform_decode for k in keys) == uniform_ok
    assert any(not k.uniform_decode for k in keys) == mixed_ok


def test_all_keys_largest_first_and_cover_dispatch():
    d = disp()
    keys = d.all_keys()
    assert len(keys) == len(set(keys)) == (4 + 2) * 4
    assert keys[0] == GraphKey(32, 32, 128, False)
    sizes = [(k.num_tokens_padded, k.num_reqs_padded) for k in keys]
    assert sizes == sorted(sizes, reverse=True)
    for n in range(0, 33):
        for m in (0, 17, 128):
            k = d.dispatch(min(n, 8), min(n, 8), m, True)
            assert k in keys


def test_graph_key_validation():
    with pytest.raises(ValueError, match="1 <= num_reqs_padded <= num_tokens_padded"):
        GraphKey(0, 1, 16, True)
    with pytest.raises(ValueError, match="not a multiple"):
        GraphKey(2, 3, 16, True)
    with pytest.raises(ValueError, match="max_len_bucket = 0"):
        GraphKey(1, 1, 0, False)
    assert GraphKey(2, 6, 16, True).query_len == 3
    assert "decode q=3" in str(GraphKey(2, 6, 16, True))
    with pytest.raises(ValueError, match="decode_query_len = 0"):
        disp(decode_query_len=0)


@pytest.mark.parametrize(("max_num_reqs", "top"), [(8, 8), (12, 16), (16, 16), (600, 512)])
def test_capture_sizes_no_batch_can_reach_are_dropped(max_num_reqs, top):
    """Default sizes 1, 2, 4, 8, 16, ... 512: a runner of `max_num_reqs` keeps those up to
    the smallest size a full batch pads to (sizes above it would never replay)."""
    d = GraphDispatcher.from_policy(BucketPolicy(capture_sizes=default_capture_sizes(512)),
                                    256, max_num_reqs=max_num_reqs)
    assert max(d.capture_sizes) == top
    assert d.capture_sizes == tuple(s for s in default_capture_sizes(512) if s <= top)
    assert d.dispatch(max_num_reqs, max_num_reqs, 100, True) is not None or max_num_reqs > 512


def test_dispatch_is_memoized_and_bounded():
    d = disp()
    first = d.dispatch(3, 3, 40, True)
    assert d.dispatch(3, 3, 41, True) is first  # same counts and bucket: the same key object
    assert d.dispatch(3, 3, 100, True) == GraphKey(4, 4, 128, True)  # another bucket
    for n in range(5000):  # a stream of distinct mixed shapes never grows it past its bound
        d.dispatch(1, 1 + n % 32, n % 128, False)
    assert len(d._memo) <= 4096
