"""The package's layers (docs/architecture.md) as import-linter checks them: nothing imports a layer above its own,
plugins import only the public API, plugin packages are independent, and no import circle exists at any level,
function-level and ``TYPE_CHECKING`` imports counted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def package_tree(tmp_path_factory) -> Path:
    """The ``infer`` package as an installed wheel lays it out (``core/`` with ``plugins/`` inside it), which is
    what import-linter reads: an editable install maps the two folders from elsewhere."""
    root = tmp_path_factory.mktemp("layout")
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.h", "*.safetensors")
    shutil.copytree(ROOT / "core", root / "infer", ignore=ignore)
    shutil.copytree(ROOT / "plugins", root / "infer" / "plugins", ignore=ignore)
    return root


def lint_imports(package_tree: Path, config: Path) -> subprocess.CompletedProcess:
    linter = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if linter is None:
        if os.environ.get("CI"):
            pytest.fail("import-linter is not installed; CI checks the layers with it (pip install -e '.[dev]')")
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    return subprocess.run(
        [linter, "--config", str(config), "--no-cache"],
        capture_output=True,
        text=True,
        cwd=package_tree,
        env={"PYTHONPATH": str(package_tree), "PATH": "/usr/bin:/bin"},
    )


def test_every_layer_contract_holds(package_tree):
    result = lint_imports(package_tree, ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_layers_contract(package_tree, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(package_tree, tree)
    model = tree / "infer" / "model" / "decoder.py"
    model.write_text(model.read_text() + "\n\ndef _upward():\n    from infer.engine.engine import Engine\n")
    result = lint_imports(tree, ROOT / "pyproject.toml")
    assert result.returncode != 0
    assert "infer.model.decoder -> infer.engine.engine" in result.stdout
