"""The Triton kernels on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before
Triton compiles anything, hence a child process), against the float64 references of
test_ops: the unified attention kernel (mixed, decode, spec-decode rows; split and merged,
in the launch or by the merge kernel; programs taking part of a KV head's query heads), the
K/V write, the fused rope + write + decode attention (an fp8 cache too) and the write +
decode attention of rotated q and k, the rotation at far positions, the sparse indexer's
scores over the paged index cache and its attention over the selection (one-slot pages),
shared-prefix attention (the prefix pass and the suffix pass from each row's start, uniform
and mixed rows), and the small-M GEMV (its residual add, norm prologue and gated epilogue
too). The GPU runs the same kernels compiled (the cuda tests of test_ops); this catches a
logic error on any machine."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed")


def test_triton_kernels_match_the_reference_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", __name__], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checked" in proc.stdout


def _patch_interpreter() -> None:
    """Make Triton 3.6's interpreter run our kernels on CPU tensors as the GPU would."""
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    from graphattn.backends import launch_config, ops, triton_kernels, triton_launch

    if hasattr(interpreter, "_patch_lang_tensor"):  # Triton 3.6 calls int() on 1-element
        patch = interpreter._patch_lang_tensor      # arrays, which numpy >= 2.4 refuses

        def patch_index(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda t: int(t.handle.data.reshape(-1)[0]))

        interpreter._patch_lang_tensor = patch_index
    # Triton 3.6's interpreter narrows to fp8 by truncation without the carry into the
    # exponent (1.97 -> 1.0); the hardware rounds to nearest even, as torch does
    convert = interpreter._convert_float
    to_torch = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype not in to_torch:
            return convert(data, input_dtype, output_dtype, rounding_mode)
        bits = np.frombuffer(data.tobytes(), dtype=f"int{input_dtype.primitive_bitwidth}")
        x = torch.from_numpy(bits.copy()).view(to_torch[input_dtype])
        return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(data.shape)

    interpreter._convert_float = convert_float
    # the interpreter has no libdevice: its cos / sin stand in for the hardware approximations
    # (the reduction to [-pi, pi] before them still runs)
    triton_kernels.libdevice = SimpleNamespace(fast_cosf=lambda x: tl.cos(x),
                                               fast_sinf=lambda x: tl.sin(x))
    resolve = launch_config.resolve_kernel
    # CPU tensors through the Triton path: the device questions answered for a CPU (in the
    # modules that ask them; this runs in its own process)
    ops.resolve_kernel = launch_config.resolve_kernel = (
        lambda kernel, device: "triton" if kernel == "triton" else resolve(kernel, device))
    triton_launch.device_index = lambda device: 0
    triton_launch.has_pdl = lambda index: False
    launch_config.num_sms = lambda device: 8


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    _patch_interpreter()
    _check_attention()
    _check_other_kernels()
    print("checked")


def _check_attention() -> None:
    """The unified kernel's rows, the fused rotary decode and head groups against float64."""
    import torch

    from graphattn.backends import launch_config, triton_launch
    from tests.graphattn.backends import test_ops as t

    for name in ("mixed", "decode", "spec_async"):
        for feature in sorted(t.FEATURES):
            t.run_steps(name, t.FEATURES[feature], "cpu", "triton", torch.float32, steps=3,
                        tol=1e-4)
    h, hkv = 8, 2
    for feature in sorted(t.FEATURES):
        f = t.FEATURES[feature]
        sinks = torch.randn(h) if f.get("sinks") else None
        for waves, merge in ((0, True), (64, True), (64, False)):  # unsplit; split, merged in
            # the launch or by the merge kernel
            config = launch_config.TritonConfig(block_n=16, waves=waves, merge=merge,
                                                max_registers=64 if waves == 0 else 0,
                                                prefetch_pages=merge)
            case = t._decode_qkv_case("cpu", torch.float32)
            qkv, pos, inv, kc, vc, qsl, seq, bt, slots = case
            ref, kref, vref = t._decode_qkv_reference(case, h, hkv, f.get("window", 0),
                                                      f.get("softcap", 0.0), sinks)
            q = qkv.view(qkv.shape[0], h + 2 * hkv, -1)[:, :h]
            out = triton_launch.triton_attention(q, kc, vc, qsl, seq, bt, 32 ** -0.5, 1, 64,
                                        f.get("window", 0), f.get("softcap", 0.0), sinks,
                                        config=config, append=t.rope_append(case, h, hkv))
            rows = bt.shape[0]
            torch.testing.assert_close(out[:rows].double(), ref[:rows], rtol=1e-4, atol=1e-4)
            assert out[rows:].abs().sum().item() == 0
            torch.testing.assert_close(kc.double(), kref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(vc.double(), vref)
            # q and k rotated already: the launch writes K/V and attends without rotating
            case = t._decode_qkv_case("cpu", torch.float32)
            heads = t._rotated_qkv(case, h, hkv).view(qkv.shape[0], h + 2 * hkv, -1)
            kc, vc = case[3], case[4]
            out = triton_launch.triton_attention(
                heads[:, :h], kc, vc, qsl, seq, bt, 32 ** -0.5, 1, 64, f.get("window", 0),
                f.get("softcap", 0.0), sinks, config=config,
                append=triton_launch.Append(heads[:, h:h + hkv], heads[:, h + hkv:], slots))
            torch.testing.assert_close(out[:rows].double(), ref[:rows], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(kc.double(), kref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(vc.double(), vref)
    t.check_head_groups("cpu", torch.float32, 1e-4)  # programs taking part of a KV group
    step, reference, _ = t.split_fold_case("cpu", torch.float32)
    for merge in (True, False):  # the in-launch fold over several chunks of splits
        torch.testing.assert_close(step(merge).double(), reference(), rtol=1e-4, atol=1e-4)
    made = triton_launch.SPLIT_COUNTERS.buffers(torch.device("cpu"))
    assert made, "no launch merged its splits itself"
    assert all(int(c.abs().sum()) == 0 for c in made)  # every last split reset its own


def _check_other_kernels() -> None:
    """fp8 caches, far rotations, the sparse indexer, shared-prefix attention, the GEMV."""
    import torch

    from tests.graphattn.backends import test_cascade as tc
    from tests.graphattn.backends import test_linear as tlin
    from tests.graphattn.backends import test_ops as t
    from tests.graphattn.backends import test_sparse_indexer as ts

    for name in ("mixed", "decode"):  # an fp8 cache, dequantized in registers
        t.run_steps(name, {}, "cpu", "triton", torch.float32, steps=3, tol=1e-4,
                    cache_dtype=torch.float8_e4m3fn, scales=(0.5, 2.0))
    t.check_far_rotation("cpu")
    t.check_fp8_fused("cpu")
    for spec, budget, pad in ((0, 400, (0, 0)), (2, 150, (2, 3))):  # one-slot pages
        ts.run_sparse(spec, budget, pad, "cpu", "triton", torch.float32, tol=1e-4)
    for feature in sorted(tc.FEATURES):  # shared-prefix attention: prefix and suffix passes
        for q_len, uniform, prefix in ((1, True, 8), (2, True, 12), (2, False, 4)):
            out, want = tc.run_cascade("cpu", torch.float32, "triton", feature, prefix, q_len,
                                       uniform)
            torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    for dtype in (torch.float32, torch.float16):  # the small-M GEMV (bf16 dots: GPU only)
        tlin.check_gemv("cpu", dtype)
        tlin.check_fused_gemv("cpu", dtype)  # the residual add, norm and gated epilogue


if __name__ == "__main__":
    main()
