"""Kernel choice and launch configs, from CPU numbers only.

Kernels, chosen per call from the device and the op's `kernel` argument (a CPU string):

- ``"triton"``: `graphattn.backends.triton_kernels` (CUDA; Triton ships with every CUDA
  build of torch and is imported on first use).
- ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` with ``block_table`` and
  ``seqused_k`` where the installed torch has them (feature-detected).
- ``"torch"``: the plain-torch path of `graphattn.backends.reference`, the float64-capable
  reference and the CPU path.
- ``"auto"``: triton on CUDA when Triton imports, else torch.

A launch config is a value (`TritonConfig`): `decode_config` and `PREFILL_CONFIG` are the
defaults, and `graphattn.backends.triton_launch.triton_attention` takes another one.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

__all__ = ["KERNELS", "PREFILL_CONFIG", "PREFIX_PASS_CONFIG", "TILE_ELEMENTS", "TritonConfig",
           "decode_config", "device_index", "fuse_rope_decode", "has_pdl", "has_triton",
           "has_varlen_paged", "head_tile", "num_sms", "pow2", "resolve_kernel", "rope_fusable",
           "split_plan", "tiles"]

KERNELS = ("auto", "triton", "varlen", "torch")


@dataclass(frozen=True, slots=True)
class TritonConfig:
    """Launch parameters of the unified kernel (`python -m bench.tune_attention` times them).

    Attributes
    ----------
    block_n : int
        Keys per inner-loop tile.
    num_warps, num_stages : int
    waves : int
        Split-KV target: programs >= waves x multiprocessors (uniform decode keys only;
        0: never split).
    pdl : bool
        Programmatic dependent launch of the attention and merge kernels (refused where
        `has_pdl` is False): a launch may overlap the previous kernel's tail, and every
        program waits for that kernel (``griddepcontrol.wait``) before it touches memory.
        `decode_config` turns it on where the device has it.
    fuse_rope : bool
        One-token decode launches of this config may take the rotary embedding and the
        K/V write in (`rope_paged_attention`; see `fuse_rope_decode`).
    head_tile : int
        Query heads of a KV head per program (0: `head_tile` picks from the shapes).
    merge : bool
        A split launch merges its splits itself: the last split of each (row, head group)
        to finish, counted on `triton_launch.SPLIT_COUNTERS`, folds the others' partials
        into the output. False (the default): a separate merge kernel after it. In
        `bench.graph_replay --modes attention` (H100, the 1B's batch-1 layers) the merge
        kernel cost less than a fold that read one split at a time (4.8 against 7.2 µs a
        layer at 512 tokens, 7.7 against 19.4 µs at 2,048); the fold now reads chunks of
        splits a load, which has not been timed.
    max_registers : int
        Registers a thread may take (Triton's ``maxnreg``; 0: the compiler's choice). Fewer
        registers let more programs share a multiprocessor, so more tiles are in flight
        (`bench.triton_compile_check` prints registers and spills).
    prefetch_pages : bool
        Each loop iteration loads the next key tile's block-table entries, so the K/V
        tiles' addresses are known an iteration ahead and Triton's software pipeline keeps
        ``num_stages - 1`` of them in flight through shared memory (2 at ``num_stages=3``).
        Off (the default), the tiles' addresses come from a load in the same iteration and
        the pipeline keeps one K/V tile at every ``num_stages`` (`bench.triton_compile_check`
        prints the buffers); on, the decode tile takes a few more registers. Not timed yet.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    waves: int = 2
    pdl: bool = False
    fuse_rope: bool = False
    head_tile: int = 0
    merge: bool = False
    max_registers: int = 0
    prefetch_pages: bool = False

    def __post_init__(self) -> None:
        r = self.max_registers
        if not isinstance(r, int) or isinstance(r, bool) or not (r == 0 or 16 <= r <= 255):
            raise ValueError(f"TritonConfig.max_registers: expected 0 (the compiler's "
                             f"choice) or 16-255 registers a thread, got {r!r}")


PREFILL_CONFIG = TritonConfig()
# the prefix pass of shared-prefix attention (`launch_shared_prefix`): `waves` is its split
# target, about two programs per multiprocessor; the best of 36 configs for 128 rows after a
# 2,048-token prefix (`python -m bench.tune_attention --cascade 2048`, bench/RESULTS.md)
PREFIX_PASS_CONFIG = TritonConfig(block_n=128, num_warps=4, num_stages=2, waves=2)
# query rows (token x head) times padded head_dim that one program's tile holds: 32 KB of
# bf16 queries, so the K / V tiles and their pipeline stages fit the shared memory too
TILE_ELEMENTS = 16384


def head_tile(group: int, query_len: int, d_pad: int, requested: int = 0) -> int:
    """Query heads of one KV head's group that one program takes (CPU numbers).

    The whole group where its `query_len` x `group` rows of `d_pad` fit `TILE_ELEMENTS`;
    else the largest power of two dividing `group` that fits (at least 1): MLA's 128 heads
    of a 576-wide latent (1,024 padded) go 16 to a program, 8 programs per KV head.
    `requested` (`TritonConfig.head_tile`) overrides when it divides the group.
    """
    if requested:
        if group % requested:
            raise ValueError(f"TritonConfig.head_tile = {requested} must divide the "
                             f"{group} query heads of a KV head")
        return requested
    fit = max(1, TILE_ELEMENTS // d_pad // max(query_len, 1))
    if group <= fit:
        return group
    tile = 1
    while tile * 2 <= fit and group % (tile * 2) == 0:
        tile *= 2
    return tile


def decode_config(programs: int, pdl: bool = False, kv_bytes: int = 2) -> TritonConfig:
    """Launch config of a uniform-decode key with `programs` = rows x KV heads.

    Few programs split each row's KV axis over about two waves of the chip (four below 96
    programs, with 128-key tiles); past about six waves the KV axis is not split and 64-key
    tiles are used. Every split bracket takes the rotary embedding and the K/V write in
    (`fuse_rope`). The brackets come from `python -m bench.tune_attention` on an H200
    (bench/RESULTS.md), over 2-byte caches.

    Past six waves a 1-byte (fp8) cache gets 128-key tiles: each loop iteration then moves
    the bytes a 2-byte 64-key tile moves. With 64-key tiles the fp8 step measured no faster
    than bf16 at 128 rows / 2,048 (bench/RESULTS.md): each program keeps one tile in
    flight, so half the bytes per tile left half the bandwidth. (The split brackets keep
    their tiles: 256-key fp8 tiles take 192 registers a thread.)

    Parameters
    ----------
    programs : int
        Rows x KV heads of the launch (CPU numbers).
    pdl : bool
        `TritonConfig.pdl` of the result (the caller knows the device: `has_pdl`).
    kv_bytes : int
        Bytes per cache element (2: bf16 / fp16; 1: fp8).
    """
    if programs < 32:
        return TritonConfig(block_n=64, num_warps=4, num_stages=2, waves=2, pdl=pdl,
                            fuse_rope=True)
    if programs < 6 * 132:
        return TritonConfig(block_n=128, num_warps=4, num_stages=2,
                            waves=4 if programs < 96 else 2, pdl=pdl, fuse_rope=True)
    return TritonConfig(block_n=128 if kv_bytes == 1 else 64, num_warps=4, num_stages=2,
                        waves=1, pdl=pdl)


@functools.cache
def has_triton() -> bool:
    """Triton imports and a CUDA device exists."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def has_pdl(index: int) -> bool:
    """Programmatic dependent launch from Triton on CUDA device `index` (Hopper or newer,
    a Triton with ``gdc_wait``)."""
    if not has_triton() or torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def has_varlen_paged() -> bool:
    """The installed torch has varlen_attn with block_table / seqused_k."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    params = inspect.signature(varlen_attn).parameters
    return "block_table" in params and "seqused_k" in params


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """The kernel a call on `device` runs ("auto" resolved); ValueError when unavailable."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel = {kernel!r}, expected one of {KERNELS}")
    if kernel == "auto":
        return "triton" if device.type == "cuda" and has_triton() else "torch"
    if kernel == "triton" and not (device.type == "cuda" and has_triton()):
        raise ValueError(f"kernel 'triton' needs CUDA and Triton; device is {device.type}")
    if kernel == "varlen" and not (device.type == "cuda" and has_varlen_paged()):
        raise ValueError(
            f"kernel 'varlen' needs CUDA and torch.nn.attention.varlen.varlen_attn with "
            f"block_table (torch {torch.__version__}, device {device.type})"
        )
    return kernel


def split_plan(rows: int, num_kv_heads: int, max_len: int, block_n: int,
               num_sms: int = 132, waves: int = 2) -> int:
    """Splits of each row's KV axis from CPU numbers only.

    Enough programs to fill about `waves` waves of the chip, at most one split per
    `block_n` keys of `max_len` (the bound). The kernel cuts each row's own length,
    read on the device, into that many equal parts.
    """
    want = max(1, -(-waves * num_sms // max(rows * num_kv_heads, 1)))
    most = max(1, -(-max(max_len, 1) // block_n))
    return min(want, most, 64)


def pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def rope_fusable(head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The fused rotary decode's shapes: K and V head_dim both `head_dim`, a power of two
    >= 16 (`rope_paged_attention` falls back to two ops otherwise; `triton_attention` refuses)."""
    return k_cache.shape[-1] == v_cache.shape[-1] == head_dim == pow2(head_dim) >= 16


def tiles(cfg: TritonConfig, rows: int, num_kv_heads: int, head_dim: int, max_len: int,
           device: torch.device, uniform: bool) -> tuple[int, int]:
    """(keys per tile, KV splits) of a launch (splits: uniform decode keys only);
    `num_kv_heads`: the programs per tile along the heads (KV heads x head groups)."""
    block_n = cfg.block_n if head_dim <= 128 else min(cfg.block_n,
                                                      32 if head_dim <= 256 else 16)
    if not uniform:
        return block_n, 1
    return block_n, split_plan(rows, num_kv_heads, max_len, block_n, num_sms(device),
                               cfg.waves)


def fuse_rope_decode(rows: int, num_kv_heads: int, head_dim: int, max_len: int,
                     device: torch.device, kernel: str = "auto") -> bool:
    """Whether a batch of `rows` one-token decode rows runs the fused launch of
    `rope_paged_attention` rather than its two ops, `rope_write_kv` then attention (CPU
    numbers only; ``rope_paged_attention(auto=True)`` decides with it when it runs).

    Fused, every program rotates its queries before its loop and holds more registers, so
    fewer programs may fit an SM: it pays where the launch splits the KV axis (few
    programs, each short) and costs where many unsplit programs fill the chip. Hence
    `TritonConfig.fuse_rope` of `decode_config`, and only where the launch splits. Kernels
    other than Triton: True (the op runs the two ops itself).
    """
    if resolve_kernel(kernel, device) != "triton":
        return True
    cfg = decode_config(rows * num_kv_heads)
    return cfg.fuse_rope and tiles(cfg, rows, num_kv_heads, head_dim, max_len, device,
                                    True)[1] > 1


@functools.cache
def _num_sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    return _num_sms_of(device_index(device))
