"""Every python block of the README runs as written (CPU), and the set-up commands stay the
two the project promises."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_two_setup_commands():
    demo = "    pip install torch==2.13.0 && pip install -e . && python -m graphattn.demo\n"
    assert demo in README
    assert ('    pip install torch==2.13.0 && pip install -e ".[test,bench]" && '
            'python -m pytest tests\n') in README


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_python_block_runs(i, tmp_path):
    proc = subprocess.run([sys.executable, "-c", BLOCKS[i]], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
