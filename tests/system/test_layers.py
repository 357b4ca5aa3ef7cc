"""The layers of docs/design.md, as the import-linter contracts in pyproject.toml state them.

CI runs ``lint-imports`` too; these tests keep the rule in the suite a developer
runs, and check that the contracts can fail.
"""

import pathlib
import shutil
import subprocess
import sys

import pytest
from mounting import REPO

ROOT = pathlib.Path(REPO)
PKG = ROOT / "aiturbofs"


def _lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the tree at ``root`` (its pyproject.toml and its aiturbofs package)."""
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(exe), "--no-cache", "--no-logo", "--config", str(root / "pyproject.toml")],
                          cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout, run.stdout


def _copy_of_the_tree(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "tree"
    shutil.copytree(PKG, root / "aiturbofs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root)
    return root


# Each contract can fail: a module planted in a copy of the tree, and what lint-imports must say of it.
BROKEN = {
    "an import up the layers": ("meta/_probe.py", "from ..vfs import Filesystem  # noqa: F401\n",
                                "aiturbofs.meta is not allowed to import aiturbofs.vfs"),
    "vfs and controller import each other": ("controller/_probe.py", "from .. import vfs  # noqa: F401\n",
                                             "aiturbofs.controller is not allowed to import aiturbofs.vfs"),
    "the controller imports the data path": ("controller/_probe.py",
                                             "from ..staging import StagingPool  # noqa: F401\n",
                                             "aiturbofs.controller is not allowed to import aiturbofs.staging"),
    "pyfuse3 below the FUSE edge": ("vfs/_probe.py", "import pyfuse3  # noqa: F401\n",
                                    "aiturbofs.vfs is not allowed to import pyfuse3"),
    "a package in no layer": ("newlayer/__init__.py", "", "aiturbofs.newlayer"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_planted_violation_breaks_a_contract(case, tmp_path):
    where, text, said = BROKEN[case]
    root = _copy_of_the_tree(tmp_path)
    probe = root / "aiturbofs" / where
    probe.parent.mkdir(exist_ok=True)
    probe.write_text(text)
    run = _lint_imports(root)
    assert run.returncode != 0
    assert said in run.stdout, run.stdout


def test_the_layers_above_the_cluster_talk_to_one_port():
    """A node alone is a port too (``SingleNode``): no code above it asks whether there is a cluster."""
    offenders = []
    for layer in ("fuse", "vfs", "persist"):
        for path in (PKG / layer).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if "cluster is None" in line or "cluster is not None" in line:
                    offenders.append(f"{path.relative_to(PKG)}:{n}: {line.strip()}")
    assert not offenders, "branches on the cluster's absence:\n" + "\n".join(offenders)
