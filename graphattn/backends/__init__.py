"""Attention backends whose builders read only CPU bounds, registered by name.

Built in: "paged", "flex", "mla", "sparse_indexer", "cross". Out-of-tree
backends register the same way (`register_backend`), see `registry`.
"""

from graphattn.backends.cross import (
    CrossAttentionBuilder,
    CrossAttentionImpl,
    CrossAttentionMetadata,
)
from graphattn.backends.flex import FlexAttentionBuilder, FlexAttentionImpl, FlexAttentionMetadata
from graphattn.backends.mla import MLABuilder, MLAImpl, MLAMetadata
from graphattn.backends.paged import (
    PagedAttentionBuilder,
    PagedAttentionImpl,
    PagedAttentionMetadata,
)
from graphattn.backends.registry import (
    AttentionBuilder,
    AttentionImpl,
    BackendMetadata,
    BackendSpec,
    BuilderContext,
    backend_names,
    get_backend,
    register_backend,
)
from graphattn.backends.sparse_indexer import (
    SparseIndexerBuilder,
    SparseIndexerImpl,
    SparseIndexerMetadata,
)
from graphattn.keys import CaptureSupport


def _cross_builder(ctx: BuilderContext) -> CrossAttentionBuilder:
    raise ValueError(
        "backend 'cross' plans from per-request encoder lengths and encoder block tables, "
        "which build(common, key) does not carry: pass builder= (an AttentionBuilder that "
        "closes over them, e.g. around CrossAttentionBuilder)"
    )


register_backend("paged", BackendSpec(
    lambda ctx: PagedAttentionBuilder(ctx.block_size, ctx.decode_query_len),
    PagedAttentionImpl, PagedAttentionMetadata, CaptureSupport.ALWAYS))
register_backend("flex", BackendSpec(
    lambda ctx: FlexAttentionBuilder(ctx.block_size, ctx.length_buckets),
    FlexAttentionImpl, FlexAttentionMetadata, CaptureSupport.ALWAYS))
register_backend("mla", BackendSpec(
    lambda ctx: MLABuilder(ctx.block_size, 4 * ctx.max_model_len, ctx.decode_query_len),
    MLAImpl, MLAMetadata, CaptureSupport.UNIFORM_BATCH))
register_backend("sparse_indexer", BackendSpec(
    lambda ctx: SparseIndexerBuilder(ctx.block_size, 1 << 20, ctx.decode_query_len),
    SparseIndexerImpl, SparseIndexerMetadata, CaptureSupport.UNIFORM_BATCH))
register_backend("cross", BackendSpec(
    _cross_builder, CrossAttentionImpl, CrossAttentionMetadata,
    CaptureSupport.UNIFORM_SINGLE_TOKEN_DECODE))

__all__ = ["AttentionBuilder", "AttentionImpl", "BackendMetadata", "BackendSpec",
           "BuilderContext", "backend_names", "get_backend", "register_backend"]
