"""CommonAttentionMetadata: device tensors plus the CPU bounds that pick shapes."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from graphattn.batch import InputBatch
from graphattn.sync import note_host_read

__all__ = ["CommonAttentionMetadata", "build_common_metadata"]


@dataclass(slots=True)
class CommonAttentionMetadata:
    """Backend-independent attention metadata of one (micro-)batch.

    Rows include padded requests (query length 0, seq len 0); tokens past
    `num_actual_tokens` are padding (slot -1).

    Attributes
    ----------
    query_start_loc : torch.Tensor
        int32 [num_reqs + 1] on device.
    query_start_loc_cpu : torch.Tensor
        int32 [num_reqs + 1] on CPU.
    seq_lens : torch.Tensor
        int32 [num_reqs] on device: true lengths (context + query).
    seq_lens_cpu_upper_bound : torch.Tensor
        int32 [num_reqs] on CPU: >= seq_lens, equal without speculative decoding.
    num_reqs : int
        Rows, padded rows included.
    num_actual_tokens : int
        Real (unpadded) query tokens, == query_start_loc_cpu[-1].
    max_query_len : int
    max_seq_len : int
        Max of the upper bound (never read from the device).
    block_table_tensor : torch.Tensor
        int32 [num_reqs, max_num_blocks] on device.
    slot_mapping : torch.Tensor
        int64 [num_tokens_padded] on device, -1 for padded tokens.
    _seq_lens_cpu : torch.Tensor, optional
        int32 [num_reqs] exact CPU lengths, when known without a device read.
    _num_computed_tokens_cpu : torch.Tensor, optional
        int32 [num_reqs] exact CPU context lengths, likewise.
    shared_rows : torch.Tensor, optional
        int32 [num_reqs] on device: the key's shared prefix length for the rows that read it
        once (`graphattn.cascade`), 0 for the others.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu_upper_bound: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    _seq_lens_cpu: torch.Tensor | None = None
    _num_computed_tokens_cpu: torch.Tensor | None = None
    shared_rows: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.num_reqs
        if n < 0:
            raise ValueError(f"num_reqs = {n}, expected >= 0")
        shapes = {
            "query_start_loc": (self.query_start_loc, (n + 1,)),
            "query_start_loc_cpu": (self.query_start_loc_cpu, (n + 1,)),
            "seq_lens": (self.seq_lens, (n,)),
            "seq_lens_cpu_upper_bound": (self.seq_lens_cpu_upper_bound, (n,)),
        }
        for name, (t, shape) in shapes.items():
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        for name in ("query_start_loc_cpu", "seq_lens_cpu_upper_bound"):
            if getattr(self, name).device.type != "cpu":
                raise ValueError(f"{name} must be on CPU, got {getattr(self, name).device}")
        bt = self.block_table_tensor
        if bt.ndim != 2 or bt.shape[0] != n or bt.shape[1] < 1:
            raise ValueError(
                f"block_table_tensor has shape {tuple(bt.shape)}, expected ({n}, "
                "max_num_blocks) with max_num_blocks >= 1"
            )
        qsl = self.query_start_loc_cpu.numpy()
        qlens = np.diff(qsl)
        if n and qlens.min() < 0:
            raise ValueError(f"query_start_loc_cpu must be non-decreasing, got {qsl.tolist()}")
        last = int(qsl[-1]) - int(qsl[0])
        if self.num_actual_tokens != last:
            raise ValueError(
                f"num_actual_tokens = {self.num_actual_tokens}, expected {last} "
                "(query_start_loc_cpu[-1] - query_start_loc_cpu[0])"
            )
        if self.slot_mapping.shape[0] < self.num_actual_tokens:
            raise ValueError(
                f"slot_mapping has {self.slot_mapping.shape[0]} entries, expected >= "
                f"num_actual_tokens = {self.num_actual_tokens}"
            )
        bound = self.seq_lens_cpu_upper_bound.numpy()
        short = bound < qlens
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(
                f"seq_lens_cpu_upper_bound[{i}] = {bound[i]} is below its query length {qlens[i]}"
            )
        top = int(bound.max(initial=0))
        if self.max_seq_len < top:
            raise ValueError(f"max_seq_len = {self.max_seq_len}, expected >= bound max {top}")
        qtop = int(qlens.max(initial=0))
        if self.max_query_len < qtop:
            raise ValueError(f"max_query_len = {self.max_query_len}, expected >= {qtop}")

    @property
    def num_tokens_padded(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def query_lens_cpu(self) -> np.ndarray:
        """int32 [num_reqs] query lengths (CPU)."""
        return np.diff(self.query_start_loc_cpu.numpy())

    @property
    def num_computed_tokens_cpu_upper_bound(self) -> np.ndarray:
        """int32 [num_reqs] context lengths from the bound (CPU; >= truth)."""
        return self.seq_lens_cpu_upper_bound.numpy() - self.query_lens_cpu

    @property
    def seq_lens_cpu(self) -> torch.Tensor:
        """Deprecated: exact CPU lengths, read from the device when not known.

        Syncs with the device (raises inside `no_host_sync()`); use
        `seq_lens_cpu_upper_bound` for shapes and kernel choice.
        """
        warnings.warn(
            "CommonAttentionMetadata.seq_lens_cpu reads the device; use seq_lens_cpu_upper_bound",
            DeprecationWarning,
            stacklevel=2,
        )
        if self._seq_lens_cpu is not None:
            return self._seq_lens_cpu
        note_host_read("CommonAttentionMetadata.seq_lens_cpu")
        return self.seq_lens.cpu()

    @property
    def num_computed_tokens_cpu(self) -> torch.Tensor:
        """Deprecated: exact CPU context lengths (syncs like `seq_lens_cpu`)."""
        warnings.warn(
            "CommonAttentionMetadata.num_computed_tokens_cpu reads the device; use "
            "num_computed_tokens_cpu_upper_bound",
            DeprecationWarning,
            stacklevel=2,
        )
        if self._num_computed_tokens_cpu is not None:
            return self._num_computed_tokens_cpu
        note_host_read("CommonAttentionMetadata.num_computed_tokens_cpu")
        return self.seq_lens.cpu() - torch.from_numpy(self.query_lens_cpu)


def build_common_metadata(batch: InputBatch) -> CommonAttentionMetadata:
    """CommonAttentionMetadata of a whole InputBatch, from CPU numbers only.

    When no draft token of the batch awaits verification the bound is exact and
    is also passed as `_seq_lens_cpu` / `_num_computed_tokens_cpu`.
    """
    exact = None
    computed = None
    if batch.seq_lens_exact:
        exact = batch.seq_lens_cpu_upper_bound
        computed = torch.from_numpy(
            batch.seq_lens_cpu_upper_bound_np - batch.num_scheduled_tokens_np
        )
    return CommonAttentionMetadata(
        query_start_loc=batch.query_start_loc,
        query_start_loc_cpu=batch.query_start_loc_cpu,
        seq_lens=batch.seq_lens,
        seq_lens_cpu_upper_bound=batch.seq_lens_cpu_upper_bound,
        num_reqs=batch.num_reqs_padded,
        num_actual_tokens=batch.num_tokens,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        block_table_tensor=batch.block_table,
        slot_mapping=batch.slot_mapping,
        _seq_lens_cpu=exact,
        _num_computed_tokens_cpu=computed,
        shared_rows=batch.shared_rows,
    )
