"""Compile the Triton kernels for an H100/H200 (sm_90) without a GPU: Triton's front end, its
passes, ptxas and cuobjdump (bundled with Triton) run on CPU, so a kernel that would not
compile on the GPU box (a shape redefined in a branch, an intrinsic the installed Triton
lacks) fails here first, and each variant's resources show (registers and stack bytes per
thread, and the programs that fit a multiprocessor by them and the shared memory; a stack
means spills; whether the loads go through a software pipeline, cp.async; shared-memory
loads of single bytes, which an fp8 tile read along its strided axis would take).

    python -m bench.triton_compile_check [--arch 90]

Compiles the unified attention kernel over its specializations (uniform or mixed rows,
split or not, softcap / window / sinks, programmatic dependent launch), the fused
rope + decode variant at the decode configs' tiles, the fp8 decode tile under register caps
(`TritonConfig.max_registers`) and with its block table prefetched (the K/V tiles'
shared-memory buffers: `tile_buffers`), the split merge, the KV writes (bf16 and fp8 caches), the
shared-prefix pass, the sparse indexer's scores and the small-M GEMV, with
pointers and strides taken divisible by 16 as the JIT specializes them at a launch on real
caches. The numbers are checked by tests/graphattn/backends/test_triton_interpreter.py
(Triton's interpreter); this checks the build.
"""

import argparse
import itertools
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from graphattn.backends.triton_kernels import (
    indexer_scores_kernel,
    merge_splits_kernel,
    rope_write_kv_kernel,
    shared_prefix_kernel,
    small_m_linear_kernel,
    unified_attention_kernel,
    write_kv_kernel,
)
from graphattn.backends.triton_launch import merge_consts

POINTERS = {
    "out": "*bf16", "part_out": "*fp32", "part_lse": "*fp32",
    "q": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "block_table": "*i32",
    "seq_lens": "*i32", "query_start_loc": "*i32", "sinks": "*fp32", "k": "*bf16",
    "v": "*bf16", "slot_mapping": "*i64", "qkv": "*bf16", "positions": "*i64",
    "inv_freq": "*fp32", "q_out": "*bf16", "kv_start": "*i32", "shared_rows": "*i32",
    "score": "*fp32", "q_idx": "*bf16", "weights": "*fp32", "idx_cache": "*bf16",
    "row_of": "*i32", "pos_of": "*i32", "k_new": "*bf16", "v_new": "*bf16", "counters": "*i32",
}
FP8_CACHES = {"k_cache": "*fp8e4nv", "v_cache": "*fp8e4nv"}
FLOATS = {"scale", "softcap", "k_scale", "v_scale"}


def resources(cubin: bytes) -> str:
    """Registers and stack bytes per thread of a cubin ("REG:n STACK:n"), by Triton's
    bundled cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    m = re.search(r"REG:\d+ STACK:\d+", out)
    return m.group(0) if m else "?"


def _registers(res: str) -> int:
    """Registers a thread from `resources`' "REG:n STACK:n" (255 where it is unknown)."""
    return int(res.split()[0].split(":")[1]) if res != "?" else 255


def registers(got: dict) -> int:
    """The registers a thread of a `build` result's kernel takes."""
    return _registers(got["resources"])


def programs_per_sm(res: str, shared: int, num_warps: int) -> int:
    """Programs of a kernel that fit one sm_90 multiprocessor (65,536 registers, 227 KB of
    shared memory a block may use), by its registers ("REG:n ...") and shared bytes."""
    return min(65536 // (max(1, _registers(res)) * 32 * num_warps), 232448 // max(1, shared),
               32)


def build(fn, consts: dict, target: GPUTarget, pointers: dict | None = None,
          **options) -> dict:
    """Compile `fn` for `target` (`pointers` overrides POINTERS' element types)."""
    types = {**POINTERS, **(pointers or {})}
    if "PREFETCH_PAGES" in fn.arg_names:
        consts = {"PREFETCH_PAGES": False, **consts}
    sig = {name: "constexpr" if name in consts else types.get(
        name, "fp32" if name in FLOATS else "i32") for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if name not in consts and (sig[name].startswith("*") or name.startswith("stride_"))}
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs=aligned), target=target,
                            options=options)
    res = resources(kernel.asm["cubin"])
    return {"shared": kernel.metadata.shared, "resources": res,
            "programs_per_sm": programs_per_sm(res, kernel.metadata.shared,
                                               options.get("num_warps", 4)),
            "pdl_wait": "griddepcontrol.wait" in kernel.asm["ptx"],
            "pipelined": "cp.async" in kernel.asm["ptx"],
            "tile_buffers": max((int(n) for n in re.findall(
                r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+", kernel.asm["ttgir"])),
                default=0),
            "byte_smem_loads": kernel.asm["ptx"].count("ld.shared.b8")}


SHAPE = dict(G=4, G_TILE=4, HEAD_DIM=64, HEAD_DIM_V=64, D_PAD=64, DV_PAD=64, PAGE=16)


def _decode_consts(block_n: int, fp8: bool, split: bool = False, rope: bool = False,
                   prefetch: bool = False) -> dict:
    """The unified kernel's constants for a one-token decode launch of `SHAPE` with PDL."""
    return dict(**SHAPE, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=block_n, UNIFORM=True, SPLIT=split,
                USE_SOFTCAP=False, USE_WINDOW=False, USE_SINKS=False, USE_PDL=True,
                APPEND=rope, ROTATE=rope, USE_KV_START=False, FP8=fp8, PREFIX_PARTS=0,
                PREFETCH_PAGES=prefetch, **merge_consts(split, 32, {"BLOCK_M": 16, **SHAPE}))


def _attention(target: GPUTarget) -> None:
    """The unified kernel over every feature flag, then the decode tiles (rotary append,
    64- to 256-key tiles, split, fp8)."""
    for uniform, split, cap, win, sinks, pdl in itertools.product(*[(False, True)] * 6):
        if split and not uniform:
            continue  # mixed batches never split
        tile = dict(BLOCK_Q=1, BLOCK_M=16, BLOCK_N=128) if uniform else dict(
            BLOCK_Q=16, BLOCK_M=64, BLOCK_N=64)
        consts = dict(**SHAPE, **tile, UNIFORM=uniform, SPLIT=split, USE_SOFTCAP=cap,
                      USE_WINDOW=win, USE_SINKS=sinks, USE_PDL=pdl,
                      APPEND=False, ROTATE=False, USE_KV_START=False, FP8=False, PREFIX_PARTS=0,
                      **merge_consts(split, 32, {**SHAPE, **tile}))
        got = build(unified_attention_kernel, consts, target, num_warps=4, num_stages=2,
                    launch_pdl=pdl)
        print("attention", {k: v for k, v in consts.items() if k.isupper() and k not in SHAPE},
              got)
        assert got["pdl_wait"] == pdl
    for rope, block_n, split, fp8 in itertools.product((False, True), (64, 128, 256),
                                                       (False, True), (False, True)):
        if block_n == 256 and not fp8:
            continue  # 256-key tiles: fp8 only (a config a caller may pass)
        consts = _decode_consts(block_n, fp8, split, rope)
        got = build(unified_attention_kernel, consts, target, FP8_CACHES if fp8 else None,
                    num_warps=4, num_stages=2, launch_pdl=True)
        print("decode", {"APPEND": rope, "BLOCK_N": block_n, "SPLIT": split, "fp8": fp8}, got)
        assert not got["byte_smem_loads"], "a K / V tile read from shared memory bytewise"
        if split:  # the last split's fold must not cost the key loop its occupancy
            apart = build(unified_attention_kernel, {**consts, "MERGE": 0}, target,
                          FP8_CACHES if fp8 else None, num_warps=4, num_stages=2,
                          launch_pdl=True)
            assert registers(got) <= registers(apart) + 16, (got, apart)
    for block_n, cap in itertools.product((64, 128), (64, 80)):
        # the fp8 decode tile under a register cap (TritonConfig.max_registers): more
        # programs a multiprocessor, at the price of the spills its stack shows
        got = build(unified_attention_kernel, _decode_consts(block_n, True), target, FP8_CACHES,
                    num_warps=4, num_stages=2, launch_pdl=True, maxnreg=cap)
        print("decode fp8, max_registers", {"BLOCK_N": block_n, "cap": cap}, got)
        assert registers(got) <= cap, got
    for fp8, stages, prefetch in itertools.product((False, True), (2, 3), (False, True)):
        # K/V tiles in flight: one at every num_stages unless the block table is prefetched
        consts = _decode_consts(128 if fp8 else 64, fp8, prefetch=prefetch)
        got = build(unified_attention_kernel, consts, target, FP8_CACHES if fp8 else None,
                    num_warps=4, num_stages=stages, launch_pdl=True)
        print("decode, pages prefetched", {"fp8": fp8, "stages": stages, "prefetch": prefetch},
              got)
        assert got["tile_buffers"] == (stages - 1 if prefetch else 1), got


def _latent_and_shared(target: GPUTarget) -> None:
    """MLA's absorbed decode, and shared-prefix attention: the suffix pass and the prefix
    pass."""
    for split in (False, True):  # MLA's absorbed decode (DeepSeek-V3: 128 heads over one
        # 576-wide latent KV head, values its first 512), 16 heads to a program
        consts = dict(G=128, G_TILE=16, HEAD_DIM=576, HEAD_DIM_V=512, D_PAD=1024,
                      DV_PAD=512, PAGE=64, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=16, UNIFORM=True,
                      SPLIT=split, USE_SOFTCAP=False, USE_WINDOW=False, USE_SINKS=False,
                      USE_PDL=True, APPEND=False, ROTATE=False, USE_KV_START=False, FP8=False,
                      PREFIX_PARTS=0, **merge_consts(split, 8, {"BLOCK_M": 16, "DV_PAD": 512}))
        got = build(unified_attention_kernel, consts, target, num_warps=4, num_stages=2,
                    launch_pdl=True)
        print("mla_decode", {"SPLIT": split}, got)
        assert got["shared"] <= 232448, "over an H100's shared memory per block"
    for uniform, fp8, fold in itertools.product((False, True), repeat=3):
        # shared-prefix attention's suffix pass (each row from its kv_start; split: its
        # partials beside the prefix's; fold: its softmax from the prefix's five partials),
        # and reads of an fp8 cache
        tile = dict(BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64) if uniform else dict(
            BLOCK_Q=16, BLOCK_M=64, BLOCK_N=64)
        consts = dict(**SHAPE, **tile, UNIFORM=uniform, SPLIT=not fold, USE_SOFTCAP=False,
                      USE_WINDOW=False, USE_SINKS=False, USE_PDL=uniform,
                      APPEND=False, ROTATE=False, USE_KV_START=True, FP8=fp8,
                      PREFIX_PARTS=5 if fold else 0, MERGE=0, MERGE_CHUNK=1)
        print("suffix", {"UNIFORM": uniform, "fp8": fp8, "PREFIX_PARTS": consts["PREFIX_PARTS"]},
              build(unified_attention_kernel, consts, target, FP8_CACHES if fp8 else None,
                    num_warps=4, num_stages=2))
    for win, fp8, q_len in itertools.product((False, True), (False, True), (0, 1)):
        consts = dict(G=4, HEAD_DIM=64, HEAD_DIM_V=64, D_PAD=64, DV_PAD=64, BLOCK_M=64,
                      BLOCK_N=128, PAGE=16, ROWS_PAD=128, LOG_ROWS=8, Q_LEN=q_len,
                      USE_SOFTCAP=False, USE_WINDOW=win)
        print("shared_prefix", {"USE_WINDOW": win, "fp8": fp8, "Q_LEN": q_len},
              build(shared_prefix_kernel, consts, target, FP8_CACHES if fp8 else None,
                    num_warps=4, num_stages=2))


def _small_kernels(target: GPUTarget) -> None:
    """The split merge, the KV writes, the small-M GEMV and DeepSeek-V3.2's indexer."""
    for sinks, pdl in itertools.product((False, True), repeat=2):
        consts = dict(HEAD_DIM_V=64, DV_PAD=64, S_PAD=4, USE_SINKS=sinks,
                      USE_PDL=pdl)
        print("merge", consts, build(merge_splits_kernel, consts, target, num_warps=4,
                                     launch_pdl=pdl))
    for fp8 in (False, True):
        print("write_kv", {"fp8": fp8}, build(write_kv_kernel, dict(
            ROW_K=256, ROW_V=256, BLOCK=256, FP8=fp8), target, FP8_CACHES if fp8 else None))
    for pdl, fp8 in itertools.product((False, True), repeat=2):
        got = build(rope_write_kv_kernel, dict(H=16, HKV=4, D=64, H_PAD=16, HKV_PAD=4,
                                               HALF_PAD=32, D_PAD=64, USE_PDL=pdl, FP8=fp8),
                    target, FP8_CACHES if fp8 else None, num_warps=4, launch_pdl=pdl)
        print("rope_write_kv", {"pdl": pdl, "fp8": fp8}, got)
        assert got["pdl_wait"] == pdl
    gemv = {"x": "*bf16", "w": "*bf16", "y": "*bf16", "delta": "*bf16", "gamma": "*bf16",
            "h_out": "*bf16"}
    for m_pad, block_n, fused in ((1, 8, False), (1, 16, False), (16, 16, False),
                                  (16, 32, False), (1, 8, True), (16, 16, True)):
        # the small-M GEMV, plain or with the residual add, norm and gated epilogue; its
        # weight tiles stream through the loop's pipeline (one row too: no tl.dot there)
        got = build(small_m_linear_kernel, dict(K=2048, M_PAD=m_pad, BLOCK_N=block_n,
                                                BLOCK_K=256, USE_PDL=False, IEEE=False,
                                                ADD=fused, NORM=fused, GLU=fused, STAGES=3),
                    target, gemv, num_warps=4, num_stages=3)
        print("small_m_linear", {"M_PAD": m_pad, "BLOCK_N": block_n, "fused": fused}, got)
        assert got["pipelined"], "the GEMV's weight loads are not pipelined"
    for fused in (False, True):  # the one-row default tile with programmatic dependent launch
        got = build(small_m_linear_kernel, dict(K=2048, M_PAD=1, BLOCK_N=8, BLOCK_K=1024,
                                                USE_PDL=True, IEEE=False, ADD=fused,
                                                NORM=fused, GLU=fused, STAGES=1),
                    target, gemv, num_warps=4, num_stages=1, launch_pdl=True)
        print("small_m_linear pdl", {"fused": fused}, got)
        assert got["pdl_wait"]
    for ieee in (False, True):  # DeepSeek-V3.2's indexer: 64 heads x 128 (bf16; float32)
        f32 = {"q_idx": "*fp32", "idx_cache": "*fp32"} if ieee else None
        print("indexer_scores", {"IEEE": ieee}, build(indexer_scores_kernel, dict(
            HI=64, HI_PAD=64, DI=128, DI_PAD=128, BLOCK_L=32 if ieee else 64, PAGE=64,
            IEEE=ieee), target,
            f32, num_warps=4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90,
                    help="CUDA compute capability to build for (90: H100 / H200)")
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    _attention(target)
    _latent_and_shared(target)
    _small_kernels(target)


if __name__ == "__main__":
    main()
