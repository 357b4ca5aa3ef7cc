"""The import direction of docs/design.md's layers: imports point down only."""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "aiturbofs"

# rank: a module may import only packages of a strictly lower rank (or its own).
RANK = {
    "cli": 7, "node": 7,
    "fuse": 6,
    "vfs": 5, "controller": 5,
    "persist": 4.7,
    "cluster": 4.5,
    "fabric": 4,
    "staging": 3,
    "planner": 2,
    "chunk": 1, "meta": 1, "backend": 1,
    "_limits": 0, "_errors": 0, "_syscalls": 0, "_version": 0, "_control_client": 0.5, "_wait": 0.7, "_threads": 0.5, "_nursery": 0.5,
}
ALLOWED_SAME_RANK = {("cli", "node")}  # the CLI is the node's front door


def _layer_of(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _imported_layers(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    layers = set()
    depth_of_pkg = len(path.relative_to(PKG).parts) - 1  # 0 for aiturbofs/x.py
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                up = node.level - 1
                if up < depth_of_pkg:
                    continue  # inside the same layer package
                if node.module:
                    layers.add(node.module.split(".")[0])
                else:
                    layers.update(a.name for a in node.names)
            elif node.module and node.module.startswith("aiturbofs."):
                layers.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("aiturbofs."):
                    layers.add(a.name.split(".")[1])
    return layers


def test_every_module_belongs_to_a_known_layer():
    for path in PKG.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == PKG:
            continue
        assert _layer_of(path) in RANK, f"{path} is in no layer of docs/design.md"


def test_imports_point_down():
    violations = []
    for path in PKG.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == PKG:
            continue
        layer = _layer_of(path)
        for target in _imported_layers(path):
            if target == layer or target not in RANK:
                continue
            if RANK[target] < RANK[layer] or (layer, target) in ALLOWED_SAME_RANK:
                continue
            violations.append(f"{path.relative_to(PKG)} ({layer}) imports {target}")
    assert not violations, "layer violations:\n" + "\n".join(violations)


def test_only_fuse_imports_pyfuse3():
    offenders = []
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if "pyfuse3" in names and _layer_of(path) not in ("fuse", "node"):
            offenders.append(str(path.relative_to(PKG)))
    assert not offenders, f"pyfuse3 imported outside fuse/node: {offenders}"


def test_checker_catches_a_violation(tmp_path):
    bad = PKG / "meta" / "_tmp_layer_probe.py"
    bad.write_text("from ..vfs import Filesystem\n")
    try:
        assert "vfs" in _imported_layers(bad)
    finally:
        bad.unlink()


def test_the_layers_above_the_cluster_talk_to_one_port():
    """A node alone is a port too (``SingleNode``): no code above it asks whether there is a cluster."""
    offenders = []
    for layer in ("fuse", "vfs", "persist"):
        for path in (PKG / layer).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if "cluster is None" in line or "cluster is not None" in line:
                    offenders.append(f"{path.relative_to(PKG)}:{n}: {line.strip()}")
    assert not offenders, "branches on the cluster's absence:\n" + "\n".join(offenders)
