"""One installed namespace, dependencies pointing one way."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# lower layers first; a module may import only its own layer and those below
LAYERS = [
    {"graphattn.sync", "graphattn.transfer", "graphattn.keys", "graphattn.buckets",
     "graphattn.checks"},
    {"graphattn.state", "graphattn.batch", "graphattn.metadata", "graphattn.ubatch",
     "graphattn.spec_decode", "graphattn.compile", "graphattn.workload",
     "graphattn.sampling", "graphattn.proposer"},
    {"graphattn.backends"},
    {"graphattn.capture"},
    {"graphattn.models", "graphattn.demo"},
]


def _layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"module {module} has no layer in tests/test_layout.py")


def _modules():
    for folder, prefix in ((ROOT / "graphattn", "graphattn"), (ROOT / "capture",
                                                               "graphattn.capture")):
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([prefix, *parts]), path


def test_imports_point_one_way():
    bad = []
    for module, path in _modules():
        if module == "graphattn":
            continue
        mine = _layer(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("capture") or name.startswith("bench"):
                    bad.append(f"{module} imports top-level {name}")
                elif name.startswith("graphattn.") and _layer(name) > mine:
                    bad.append(f"{module} (layer {mine}) imports {name} (layer {_layer(name)})")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_wheel_installs_one_namespace(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", ".whl", ".pytest_cache", ".ruff_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(src)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("graphattn-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"graphattn"}
    assert "graphattn/capture/runner.py" in names and "graphattn/__init__.py" in names
    assert not any(n.startswith(("bench/", "tests/", "capture/")) for n in names)
