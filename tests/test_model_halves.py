"""model/ in two halves: the torch-free contract that serve/ and export/ read (config, mask kinds,
attention paths, signature, export format, projection, text) and the torch reference modules; imports point one
way (torch modules -> contract), with no circle anywhere in model/ (function-level imports included)."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.subprocess_env import REPO, repo_env

CONTRACT = ("config", "mask_kinds", "attention_paths", "signature", "export_format", "projection", "tasks", "text")
MODEL = REPO / "model"


def model_imports(module: str) -> set[str]:
    """The model.* modules `module` imports, at any depth of its code."""
    tree = ast.parse((MODEL / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "model":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("model."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("model."))
    return found - {module}


def test_the_contract_half_imports_only_the_contract_half():
    for module in CONTRACT:
        assert model_imports(module) <= set(CONTRACT), (module, model_imports(module) - set(CONTRACT))


def test_no_import_circle_in_model():
    modules = [p.stem for p in MODEL.glob("*.py") if p.stem != "__init__"]
    graph = {m: model_imports(m) & set(modules) for m in modules}
    state: dict[str, int] = {}

    def visit(node: str, path: tuple[str, ...]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, f"import circle: {' -> '.join(path + (node, nxt))}"
            if nxt not in state:
                visit(nxt, path + (node,))
        state[node] = 2

    for module in modules:
        if module not in state:
            visit(module, ())


def test_the_contract_half_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            + "".join(f"import model.{m}\n" for m in CONTRACT)
            + "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=repo_env(), capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
