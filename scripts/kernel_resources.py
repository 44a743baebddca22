"""Resources of the unified attention kernel compiled for sm90 on any machine, no GPU needed
(a development aid): registers and stack (spills) per thread from the cubin (Triton's
bundled ptxas and cuobjdump), shared memory, for the decode configs with and without the
fused rotary embedding (bf16, head_dim 64, GQA 4, page 16, PDL).

    python scripts/kernel_resources.py
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from graphattn.backends import triton_kernels

TYPES = {"part_out": "*fp32", "part_lse": "*fp32", "block_table": "*i32", "seq_lens": "*i32",
         "query_start_loc": "*i32", "positions": "*i64", "inv_freq": "*fp32",
         "slot_mapping": "*i64", "scale": "fp32", "softcap": "fp32"}
POINTERS = ("out", "lse_out", "q", "k_cache", "v_cache", "sinks")


def resources(rope: bool, block_n: int, warps: int, stages: int, split: bool) -> str:
    fn = triton_kernels.unified_attention_kernel
    const = dict(G=4, HEAD_DIM=64, HEAD_DIM_V=64, D_PAD=64, DV_PAD=64, BLOCK_Q=1, BLOCK_M=16,
                 BLOCK_N=block_n, PAGE=16, UNIFORM=True, SPLIT=split, USE_SOFTCAP=False,
                 USE_WINDOW=False, USE_SINKS=False, WRITE_LSE=False, USE_PDL=True,
                 ROPE_APPEND=rope)
    sig = {n: "constexpr" if n in const else "*bf16" if n in POINTERS else TYPES.get(n, "i32")
           for n in fn.arg_names}
    # what the JIT specializes at a launch on the bench's tensors: pointers and strides
    # divisible by 16 (the offsets that are not: the strides of 1 and num_* counts)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
               if n not in const and (sig[n].startswith("*") or n.startswith("stride_"))}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()},
                    attrs=aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    m = re.search(r"REG:\d+ STACK:\d+", out)
    vec = re.findall(r"sizePerThread = \[([0-9, ]+)\]", kernel.asm["ttgir"])
    return (f"{m.group(0) if m else out[-200:]} shared {kernel.metadata.shared} B, "
            f"layouts {sorted(set(vec))}, async copies "
            f"{kernel.asm['ttgir'].count('async_copy_global_to_local')}")


def main() -> None:
    for rope in (False, True):
        for block_n, warps, stages, split in ((64, 4, 2, False), (128, 4, 2, True),
                                              (128, 4, 2, False)):
            print(f"rope {rope!s:5} block_n {block_n:3} warps {warps} stages {stages} "
                  f"split {split!s:5}: {resources(rope, block_n, warps, stages, split)}")


if __name__ == "__main__":
    main()
