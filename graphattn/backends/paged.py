"""Paged KV-cache attention for mixed decode + prefill batches (plain torch)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import numpy as np
import torch

from graphattn.backends import ops  # noqa: F401  (registers torch.ops.graphattn)
from graphattn.backends.launch_config import KERNELS
from graphattn.backends.ops import kv_bounds
from graphattn.backends.reference import block_count
from graphattn.backends.registry import BackendMetadata, PadValue
from graphattn.keys import GraphKey
from graphattn.metadata import CommonAttentionMetadata

__all__ = ["PagedAttentionBuilder", "PagedAttentionImpl", "PagedAttentionMetadata", "PagedPlan",
           "PagedTensors", "check_key_fits", "leading_decodes", "paged_tensors"]


def leading_decodes(query_lens: np.ndarray, decode_query_len: int) -> int:
    """Rows at the front whose query length is exactly `decode_query_len`."""
    is_dec = query_lens == decode_query_len
    return int(is_dec.size if is_dec.all() else np.argmin(is_dec))


def check_key_fits(common: CommonAttentionMetadata, key: GraphKey) -> None:
    """Raise ValueError unless the batch was padded to `key` and fits its bucket."""
    got = (common.num_reqs, common.num_tokens_padded)
    want = (key.num_reqs_padded, key.num_tokens_padded)
    if got != want:
        raise ValueError(f"batch padded to (reqs, tokens) = {got}, expected {want} for {key}")
    if common.max_seq_len > key.max_len_bucket:
        raise ValueError(
            f"max_seq_len {common.max_seq_len} exceeds the key's bucket {key.max_len_bucket}"
        )
    if key.uniform_decode:
        q = common.query_lens_cpu
        bad = (q != key.query_len) & (q != 0)
        if bad.any():
            raise ValueError(
                f"uniform key {key} needs query length {key.query_len} in every real row, got "
                f"{q[bad].tolist()}"
            )


@dataclass(slots=True)
class PagedTensors(BackendMetadata):
    """Device tensors of a paged-cache backend: the static inputs of its graphs.

    Attributes
    ----------
    query_start_loc : int32 [rows + 1]; seq_lens : int32 [rows] (true lengths);
    block_table : int32 [rows, max_blocks]; slot_mapping : int64 [tokens].
    """

    tensor_fields: ClassVar[tuple[str, ...]] = (
        "query_start_loc", "seq_lens", "block_table", "slot_mapping")
    pad_values: ClassVar[dict[str, PadValue]] = {"slot_mapping": -1, "query_start_loc": "edge"}
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


def paged_tensors(common: CommonAttentionMetadata) -> dict[str, torch.Tensor]:
    """The PagedTensors fields of `common`, as keyword arguments."""
    return dict(query_start_loc=common.query_start_loc, seq_lens=common.seq_lens,
                block_table=common.block_table_tensor, slot_mapping=common.slot_mapping)


@dataclass(frozen=True, slots=True)
class PagedPlan:
    """The CPU ints of a paged plan (fixed by the key in a captured graph).

    Attributes
    ----------
    num_decodes, num_decode_tokens, decode_query_len : int
        The first `num_decodes` rows run the batched decode path, each with
        `decode_query_len` tokens; the rest run the token-level path.
    max_len : int
        Upper bound of every row's length (bound max, or the key's bucket).
    num_kv_blocks : int
        Blocks read per row, ceil(max_len / block_size).
    shared_prefix : int
        Tokens of the prefix the group of `shared_rows` reads once per KV head (the key's;
        0: off).
    """

    num_decodes: int
    num_decode_tokens: int
    decode_query_len: int
    max_len: int
    num_kv_blocks: int
    shared_prefix: int = 0

    def as_kwargs(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class PagedAttentionMetadata(PagedTensors):
    """Plan (CPU ints, the fields of `PagedPlan`) and device tensors (see `PagedTensors`)
    of paged attention; `kv_bounds` holds (num_kv_blocks, max_len) as the op takes them
    (int64 CPU [2], see ``torch.ops.graphattn.paged_attention``); with `shared_prefix`,
    `shared_rows` (int32 [rows]) holds it for the rows that read it once, 0 for the others
    (``torch.ops.graphattn.cascade_attention``)."""

    num_decodes: int
    num_decode_tokens: int
    decode_query_len: int
    max_len: int
    num_kv_blocks: int
    shared_prefix: int
    shared_rows: torch.Tensor | None
    kv_bounds: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.kv_bounds = kv_bounds(self.num_kv_blocks, self.max_len)


class PagedAttentionBuilder:
    """Plans PagedAttentionMetadata from CPU numbers only.

    Parameters
    ----------
    block_size : int
    decode_query_len : int
        Query length of a decode row (1 + speculative tokens).
    """

    def __init__(self, block_size: int, decode_query_len: int = 1) -> None:
        if block_size < 1 or decode_query_len < 1:
            raise ValueError(
                f"block_size = {block_size} and decode_query_len = {decode_query_len} must be >= 1"
            )
        self.block_size = block_size
        self.decode_query_len = decode_query_len

    def plan(self, common: CommonAttentionMetadata, key: GraphKey | None,
             uniform_only: bool = False) -> PagedPlan:
        """The CPU ints: from the key when given (so a graph's plan is fixed), else the batch.

        `uniform_only` rejects mixed keys (backends captured for uniform batches only).
        """
        if key is not None and uniform_only and not key.uniform_decode:
            raise ValueError(f"{type(self).__name__} captures uniform batches only, got {key}")
        if key is not None:
            check_key_fits(common, key)
            nd = key.num_reqs_padded if key.uniform_decode else 0
            qd = key.query_len if key.uniform_decode else self.decode_query_len
            max_len = key.max_len_bucket
        else:
            qd = self.decode_query_len
            nd = leading_decodes(common.query_lens_cpu, qd)
            max_len = common.max_seq_len
        nb = block_count(max_len, self.block_size, common.block_table_tensor.shape[1])
        shared = key.shared_prefix if key is not None and common.shared_rows is not None else 0
        return PagedPlan(num_decodes=nd, num_decode_tokens=nd * qd, decode_query_len=qd,
                         max_len=max_len, num_kv_blocks=nb, shared_prefix=shared)

    def build(self, common: CommonAttentionMetadata,
              key: GraphKey | None = None) -> PagedAttentionMetadata:
        """Metadata of `common`; with `key`, the plan of that key's graph."""
        return PagedAttentionMetadata(**self.plan(common, key).as_kwargs(),
                                      **paged_tensors(common), shared_rows=common.shared_rows)


class PagedAttentionImpl:
    """Writes K/V into the paged cache, then attends (fixed shapes for a plan).

    Both steps are the registered custom ops of `graphattn.backends.ops`, so a
    torch.compile'd model keeps them opaque and writes the caches in place.

    Parameters
    ----------
    num_heads, head_dim, num_kv_heads : int
    scale : float, optional
        Default head_dim ** -0.5.
    window : int
        Sliding window (keys > position - window are seen); 0: full causal.
    softcap : float
        Attention logit soft cap; 0: none.
    sinks : torch.Tensor, optional
        [num_heads] learned sink logits.
    kernel : {"auto", "triton", "varlen", "torch"}
        See `graphattn.backends.launch_config`; "auto" is Triton on CUDA, torch elsewhere.
    fuse_rope : bool, optional
        Whether a batch of one-token decode rows writes its new K/V inside the attention
        launch: `forward` through ``torch.ops.graphattn.append_paged_attention``,
        `forward_qkv` through ``torch.ops.graphattn.rope_paged_attention`` (the rotation
        too), rather than the write (`rope_write_kv` in `forward_qkv`) then attention, as
        for every other batch. None: where it pays
        (`graphattn.backends.launch_config.fuse_rope_decode`, decided by the op when it
        runs).
    k_scale, v_scale : float
        Per-tensor scales of an fp8 KV cache (``float8_e4m3fn``: it stores K / k_scale and
        V / v_scale, clamped to +-448, and the kernels dequantize in registers); 1 for a
        cache in the model's dtype.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int | None = None,
                 scale: float | None = None, window: int = 0, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None, kernel: str = "auto",
                 fuse_rope: bool | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of {self.num_kv_heads}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel = {kernel!r}, expected one of {KERNELS}")
        if window < 0 or softcap < 0:
            raise ValueError(f"window = {window} and softcap = {softcap} must be >= 0")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks has shape {tuple(sinks.shape)}, expected ({num_heads},)")
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = int(window)
        self.softcap = float(softcap)
        self.sinks = sinks
        self.kernel = kernel
        self.fuse_rope = fuse_rope
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"k_scale = {k_scale} and v_scale = {v_scale} must be > 0")
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: PagedAttentionMetadata) -> torch.Tensor:
        """Attention output.

        Parameters
        ----------
        q : [T, H, D]; k, v : [T, Hkv, D]
            T = tokens of the (padded) batch.
        kv_cache : (k_cache, v_cache)
            Each [num_blocks + 1, block_size, Hkv, D] (last block: sink).

        Returns
        -------
        torch.Tensor
            [T, H, D]; padded tokens give 0.
        """
        k_cache, v_cache = kv_cache
        if self.fuse_rope is False or meta.shared_prefix:
            torch.ops.graphattn.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.kernel,
                                         self.k_scale, self.v_scale)
            return self._attend(q, k_cache, v_cache, meta)
        # the op picks the fused decode path from the plan's ints when it runs (as in
        # `forward_qkv`)
        return torch.ops.graphattn.append_paged_attention(
            q, k, v, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
            meta.slot_mapping, self.scale, meta.num_decodes, meta.decode_query_len,
            meta.kv_bounds, self.window, self.softcap, self.sinks, self.kernel, self.k_scale,
            self.v_scale, self.fuse_rope is None)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: PagedAttentionMetadata) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, meta, self.scale, self.window, self.softcap,
                               self.sinks, self.kernel, self.k_scale, self.v_scale)

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor],
                    meta: PagedAttentionMetadata) -> torch.Tensor:
        """Attention output from a fused qkv projection, rotary embedding applied here.

        ``torch.ops.graphattn.rope_paged_attention``: the rotation of q and k (NeoX halves)
        and the K/V write in one launch, then attention (two launches per layer on CUDA); a
        batch of one-token decode rows (the plan says so, read when the op runs) in one
        launch where `fuse_rope` says so. With `fuse_rope` False or a shared prefix:
        ``rope_write_kv`` then the attention op.

        Parameters
        ----------
        qkv : [T, (H + 2 Hkv) * D]
        positions : int64 [T]
        inv_freq : float32 [D / 2] (`graphattn.backends.rope.inv_frequencies`)
        kv_cache : (k_cache, v_cache)

        Returns
        -------
        torch.Tensor
            [T, H, D]; padded tokens give 0.
        """
        k_cache, v_cache = kv_cache
        if self.fuse_rope is False or meta.shared_prefix:
            q = torch.ops.graphattn.rope_write_kv(qkv, positions, inv_freq, k_cache, v_cache,
                                                  meta.slot_mapping, self.num_heads,
                                                  self.num_kv_heads, self.kernel, self.k_scale,
                                                  self.v_scale)
            return self._attend(q, k_cache, v_cache, meta)
        # the op picks the fused decode path from the plan's ints when it runs: one compiled
        # forward for decode and mixed batches, no guard on the length bucket
        return torch.ops.graphattn.rope_paged_attention(
            qkv, positions, inv_freq, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
            meta.block_table, meta.slot_mapping, self.scale, self.num_heads, self.num_kv_heads,
            meta.num_decodes, meta.decode_query_len, meta.kv_bounds, self.window, self.softcap,
            self.sinks, self.kernel, self.k_scale, self.v_scale, self.fuse_rope is None)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: PagedAttentionMetadata, scale: float, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None,
                    kernel: str = "auto", k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """Attention over what the cache holds (``torch.ops.graphattn.paged_attention`` of `meta`,
    or ``cascade_attention`` when it has a shared prefix)."""
    if meta.shared_prefix:
        return torch.ops.graphattn.cascade_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
            meta.slot_mapping, scale, meta.num_decodes, meta.decode_query_len, meta.kv_bounds,
            meta.shared_rows, meta.shared_prefix, window, softcap, sinks, kernel, k_scale,
            v_scale)
    return torch.ops.graphattn.paged_attention(
        q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
        meta.slot_mapping, scale, meta.num_decodes, meta.decode_query_len, meta.kv_bounds,
        window, softcap, sinks, kernel, k_scale, v_scale)
