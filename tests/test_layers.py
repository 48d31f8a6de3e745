"""Layers point down: the lower packages (models, rollout, components, distributed) never import the runtime or the
trainer, and nothing in the package edits sys.path (issue 17). Imports are read with ast, lazy ones inside
functions included, so a deferred `from ..runtime import x` is caught as well as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "torchplex"
LOWER = ("models", "rollout", "components", "distributed")
UPPER = ("torchplex.runtime", "torchplex.train")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, source: str | None = None) -> list[str]:
    """Absolute names of every module `path` imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = []
    for node in ast.walk(tree):  # every node: imports inside functions count
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.append(module)
            names += [f"{module}.{a.name}" for a in node.names]  # `from .. import runtime`
    return names


def _upward(path: Path, source: str | None = None) -> list[str]:
    return [m for m in imported_modules(path, source) if any(m == u or m.startswith(u + ".") for u in UPPER)]


def test_lower_layers_do_not_import_runtime_or_train():
    offenders = {}
    for layer in LOWER:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            if bad := _upward(path):
                offenders[str(path.relative_to(PACKAGE))] = bad
    assert not offenders, f"lower layers import the runtime or the trainer: {offenders}"


def test_the_check_sees_relative_and_lazy_imports():
    """The checker itself: lazy relative imports inside a function are reported (components/master_weights.py
    imported runtime.memory before issue 17)."""
    probe = PACKAGE / "components" / "probe.py"
    source = "def f():\n    from ..runtime.memory import TensorGroup\n    from .. import train\n"
    assert _upward(probe, source) == ["torchplex.runtime.memory", "torchplex.runtime.memory.TensorGroup",
                                      "torchplex.train"]


def test_package_does_not_edit_sys_path():
    edits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                edits.append(str(path.relative_to(PACKAGE)))
    assert not edits, f"sys.path used in the package: {sorted(set(edits))}"
