"""The import direction (config -> detect -> rewrite -> lower -> kernel): the runtime in lowering/
never imports the compiler front, and it installs as hilbert_fx.lowering, not as a generic
top-level `lowering` module."""
from __future__ import annotations

import ast
import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parent.parent


def imports(path: pathlib.Path):
    """(module, level) of every import statement of a file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level


def test_the_runtime_never_imports_the_compiler_front():
    files = sorted((ROOT / "lowering").glob("*.py"))
    assert files
    for path in files:
        for module, level in imports(path):
            assert level <= 1, f"{path.name}: relative import above its package ({module})"
            if level == 0:
                top = module.split(".")[0]
                assert top not in ("hilbert_fx", "lowering"), f"{path.name} imports {module}"


def test_the_compiler_front_reaches_the_runtime_as_its_subpackage():
    for path in sorted((ROOT / "hilbert_fx").glob("*.py")):
        for module, level in imports(path):
            assert not (level == 0 and module.split(".")[0] == "lowering"), \
                f"{path.name} imports the runtime as a top-level module ({module})"


def test_the_distribution_installs_no_top_level_lowering():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "lowering" not in config["packages"]
    assert config["package-dir"]["hilbert_fx.lowering"] == "lowering"
