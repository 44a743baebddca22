"""Attention backends whose builders read only CPU bounds; registry of name -> spec."""

from capture.dispatcher import CaptureSupport
from graphattn.backends.cross import CrossAttentionBuilder, CrossAttentionImpl
from graphattn.backends.flex import FlexAttentionBuilder, FlexAttentionImpl
from graphattn.backends.mla import MLABuilder, MLAImpl
from graphattn.backends.paged import PagedAttentionBuilder, PagedAttentionImpl
from graphattn.backends.registry import (
    AttentionBackendEnum,
    BackendSpec,
    get_backend,
    register_backend,
)
from graphattn.backends.sparse_indexer import SparseIndexerBuilder, SparseIndexerImpl

register_backend(AttentionBackendEnum.PAGED, BackendSpec(
    PagedAttentionBuilder, PagedAttentionImpl, CaptureSupport.ALWAYS))
register_backend(AttentionBackendEnum.FLEX, BackendSpec(
    FlexAttentionBuilder, FlexAttentionImpl, CaptureSupport.ALWAYS))
register_backend(AttentionBackendEnum.MLA, BackendSpec(
    MLABuilder, MLAImpl, CaptureSupport.UNIFORM_BATCH))
register_backend(AttentionBackendEnum.SPARSE_INDEXER, BackendSpec(
    SparseIndexerBuilder, SparseIndexerImpl, CaptureSupport.UNIFORM_BATCH))
register_backend(AttentionBackendEnum.CROSS, BackendSpec(
    CrossAttentionBuilder, CrossAttentionImpl, CaptureSupport.UNIFORM_SINGLE_TOKEN_DECODE))

__all__ = ["AttentionBackendEnum", "BackendSpec", "get_backend", "register_backend"]
