import pytest

from graphattn.backends import BuilderContext, backend_names, get_backend, register_backend
from graphattn.backends.paged import (
    PagedAttentionBuilder,
    PagedAttentionImpl,
    PagedAttentionMetadata,
    PagedPlan,
)
from graphattn.buckets import LengthBuckets
from graphattn.keys import CaptureSupport
from tests.helpers import two_request_batch


def _ctx(q=1):
    return BuilderContext(4, q, 32, LengthBuckets(32), "cpu")


def test_every_backend_registered_by_name():
    assert {"cross", "flex", "mla", "paged", "sparse_indexer"} <= set(backend_names())
    for name in backend_names():
        assert isinstance(get_backend(name).capture_support, CaptureSupport)
    spec = get_backend("paged")
    assert (spec.impl_cls, spec.metadata_cls) == (PagedAttentionImpl, PagedAttentionMetadata)
    assert isinstance(spec.make_builder(_ctx(3)), PagedAttentionBuilder)
    assert spec.make_builder(_ctx(3)).decode_query_len == 3
    assert get_backend("cross").capture_support == CaptureSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert get_backend("mla").capture_support == CaptureSupport.UNIFORM_BATCH
    assert get_backend("flex").capture_support == CaptureSupport.ALWAYS
    assert PagedAttentionMetadata.pad_values == {"slot_mapping": -1, "query_start_loc": "edge"}
    assert get_backend("cross").metadata_cls.pad_values["cross_slot_mapping"] == -1


def test_cross_factory_says_what_it_needs():
    with pytest.raises(ValueError, match="backend 'cross'.*pass builder="):
        get_backend("cross").make_builder(_ctx())


def test_plan_is_frozen():
    *_, common = two_request_batch()
    plan = PagedAttentionBuilder(4).plan(common, None)
    assert isinstance(plan, PagedPlan)
    with pytest.raises(AttributeError):
        plan.max_len = 3


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'nope', expected one of"):
        get_backend("nope")
    with pytest.raises(ValueError, match="non-empty str"):
        register_backend("", get_backend("paged"))
