"""bench.kernel_profile: its mode list is checked before anything runs, and on CUDA it
profiles runner modes, the transformers model among them, in its own process."""

import json
import subprocess
import sys

import pytest


def _profile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.kernel_profile", *args],
                          capture_output=True, text=True, timeout=600)


def test_an_unknown_mode_is_refused_by_name():
    proc = _profile("--modes", "graphattn_graphs,no_such_mode")
    assert proc.returncode == 2
    assert "--modes: unknown ['no_such_mode']" in proc.stderr


@pytest.mark.cuda
def test_runner_modes_are_profiled_kernel_by_kernel(tmp_path):
    proc = _profile("--model", "tiny", "--modes", "graphattn_graphs,hf_graphs", "--out",
                    str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(next(tmp_path.glob("kernel_profile_tiny_1_512_*.json")).read_text())["rows"]
    assert [r["mode"] for r in rows] == ["graphattn_graphs", "hf_graphs"]
    for r in rows:
        assert r["step_us"] > 0 and r["kernel_us"] > 0 and r["kernels"]
