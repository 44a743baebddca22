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
     "graphattn.checks", "graphattn.config", "graphattn.block_holders", "graphattn.blocks",
     "graphattn.artifacts"},
    {"graphattn.state", "graphattn.batch", "graphattn.metadata", "graphattn.ubatch",
     "graphattn.spec_decode", "graphattn.compile", "graphattn.sampling", "graphattn.proposer",
     "graphattn.cascade"},
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


def _imports(path: Path):
    """(module, [names]) of each absolute import in `path` (names empty for ``import m``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def _dev_files():
    for folder in ("bench", "scripts", "tests"):
        yield from (ROOT / folder).rglob("*.py")


def test_imports_point_one_way():
    bad = []
    for module, path in _modules():
        if module == "graphattn":  # the public surface, imported lazily
            continue
        mine = _layer(module)
        for name, _ in _imports(path):
            if name.startswith(("capture", "bench", "tests")):
                bad.append(f"{module} imports top-level {name}")
            elif name.startswith("graphattn.") and _layer(name) > mine:
                bad.append(f"{module} (layer {mine}) imports {name} (layer {_layer(name)})")
    for path in _dev_files():
        for name, _ in _imports(path):
            if name == "capture" or name.startswith("capture."):
                bad.append(f"{path.relative_to(ROOT)} imports top-level {name} (a second copy "
                           "of graphattn.capture)")
    assert not bad, "\n".join(bad)


def _defined(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_each_name_is_imported_from_its_home():
    """A name comes from the module that defines it; only packages (their __init__) re-export."""
    homes = {m: p for m, p in _modules()}
    defined = {m: _defined(p) for m, p in homes.items() if p.name != "__init__.py"}
    bad = []
    for path in [p for _, p in _modules()] + list(_dev_files()):
        for module, names in _imports(path):
            if module in defined:
                bad += [f"{path.relative_to(ROOT)}: {n} from {module}" for n in names
                        if n not in defined[module] and f"{module}.{n}" not in homes]
    assert not bad, "names imported from a module that does not define them:\n" + "\n".join(bad)


def _is_triton_kernel(fn: ast.AST) -> bool:
    return any("jit" in ast.unparse(d) for d in getattr(fn, "decorator_list", ()))


def test_functions_are_short():
    """No function over 60 lines in the package, Triton kernels excepted."""
    long = []
    for module, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not (
                    _is_triton_kernel(node)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{module}.{node.name}: {n} lines")
    assert not long, "\n".join(long)


def test_public_surface():
    import graphattn

    for name in graphattn.__all__:
        assert getattr(graphattn, name).__name__ == name


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
