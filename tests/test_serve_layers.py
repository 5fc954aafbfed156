"""serve/ in layers whose imports point down only (docs/serving.md "Layers"), guarded as model/'s halves are
(tests/test_model_halves.py): assembly -> transport -> protocols -> core -> backend, each importing only its own
layer and those below, plus the base modules every layer may use (serve/config.py, errors.py, logs.py) and the
generated code (serve/_proto, serve/_native). Function-level imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.subprocess_env import REPO

SERVE = REPO / "serve"
LAYERS = ("backend", "core", "protocols", "transport", "assembly")  # bottom to top
BASE = ("config", "errors", "logs")


def modules() -> list[Path]:
    return [p for p in sorted(SERVE.rglob("*.py")) if not p.relative_to(SERVE).parts[0].startswith("_")]


def serve_imports(path: Path) -> set[str]:
    """The serve.* modules `path` imports, at any depth of its code (a name imported from a package counts as
    that package's module when it is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "serve":
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if (SERVE.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                         or (SERVE.parent / f"{node.module}.{a.name}".replace(".", "/")).is_dir())
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "serve")
    return found


def layer_of(module: str) -> str | None:
    """The layer of a dotted serve module (None: the package itself, a base module or generated code)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def violations(path: Path, module: str) -> list[str]:
    """Each import of `path` (the code of serve module `module`) that points to a higher layer; a base module's
    import of any layer."""
    own, found = layer_of(module), []
    for target in sorted(serve_imports(path)):
        layer = layer_of(target)
        if own is None and path.stem in BASE:
            below = target.split(".")[1:2]  # [] for `from serve import x` (x itself is a target of its own)
            if layer is not None or below and below[0] not in (*BASE, "_proto"):
                found.append(f"{module} (base) imports {target}")
        elif own is not None and layer is not None and LAYERS.index(layer) > LAYERS.index(own):
            found.append(f"{module} ({own}) imports {target} ({layer})")
    return found


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(SERVE)))
def test_a_module_imports_only_its_layer_and_those_below(path):
    module = ".".join(("serve", *path.relative_to(SERVE).with_suffix("").parts))
    assert violations(path, module) == []


def test_the_guard_catches_an_upward_import_even_inside_a_function(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from serve.protocols import edge\n")
    assert "serve.core.bad (core) imports serve.protocols.edge (protocols)" in violations(bad, "serve.core.bad")
    base = tmp_path / "errors.py"
    base.write_text("import serve.core.engine\n")
    assert violations(base, "serve.errors") == ["serve.errors (base) imports serve.core.engine"]


def test_a_base_module_may_import_another_base_module_from_the_package(tmp_path):
    base = tmp_path / "errors.py"
    base.write_text("from serve import logs\n")
    assert violations(base, "serve.errors") == []
