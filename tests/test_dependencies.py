"""Every declared dependency is imported by the package or its tools, and every third-party import is declared
(issue 21: torchtitan was declared, never imported, and pulled in wandb, datasets, pandas, pyarrow...)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
# distribution name -> the module it is imported as, where they differ
IMPORT_NAME = {"pillow": "PIL", "math-verify": "math_verify"}
# modules only tests, benchmarks or optional back ends use; not part of the runtime dependencies
OPTIONAL = {"pytest", "sglang", "torchvision", "tomli", "wandb"}


def _declared() -> list[str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].strip().lower() for d in deps]


def _imported() -> set[str]:
    names: set[str] = set()
    for path in list((REPO / "torchplex").rglob("*.py")) + list((REPO / "tools").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
    return names


def test_every_declared_dependency_is_imported():
    imported = _imported()
    tops = {name.split(".")[0] for name in imported}
    for dist in _declared():
        module = IMPORT_NAME.get(dist, dist)
        if dist == "tensorboard":  # used through torch's writer, which needs the package
            assert "torch.utils.tensorboard" in imported
        elif dist != "tomli":  # the 3.10 fallback of tomllib
            assert module in tops, f"{dist} is declared in pyproject.toml but nothing imports {module}"


def test_every_third_party_import_is_declared():
    declared = {IMPORT_NAME.get(d, d) for d in _declared()}
    local = {"torchplex", "tools", "benchmarks"}
    tops = {name.split(".")[0] for name in _imported()}
    undeclared = sorted(t for t in tops - declared - local - OPTIONAL if t not in sys.stdlib_module_names)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
