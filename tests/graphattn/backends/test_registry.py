import pytest

from capture.dispatcher import CaptureSupport
from graphattn.backends import AttentionBackendEnum, get_backend
from graphattn.backends.paged import PagedAttentionBuilder, PagedAttentionImpl


def test_every_backend_registered():
    for name in AttentionBackendEnum:
        spec = get_backend(name)
        assert isinstance(spec.capture_support, CaptureSupport)
    spec = get_backend("paged")
    assert (spec.builder_cls, spec.impl_cls) == (PagedAttentionBuilder, PagedAttentionImpl)
    assert get_backend("cross").capture_support == CaptureSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert get_backend(AttentionBackendEnum.MLA).capture_support == CaptureSupport.UNIFORM_BATCH
    assert get_backend("flex").capture_support == CaptureSupport.ALWAYS


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'nope', expected one of"):
        get_backend("nope")
