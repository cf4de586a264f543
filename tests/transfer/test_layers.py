"""Who imports what across the KV seam: the edge and the router know the
`kv_transfer_params` contract (transfer/params.py) and no other part of `transfer/`
(the connector runs in vLLM's engine process), and load neither vLLM nor NIXL."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GATEWAYS = sorted([*ROOT.glob("services/edge/*.py"), *ROOT.glob("services/router/*.py")])
CONTRACT = "transfer.params"
ENGINE_STACK = ("vllm", "nixl")


def imports(source: str, package: str) -> list[tuple[str, bool]]:
    """(module, runs at import time) for every import statement in `source`, a module of
    `package`; `from a import b` names both `a` and `a.b` (b may be a module)."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                found.append((base, top))
                found.extend((f"{base}.{alias.name}", top) for alias in child.names
                             if alias.name != "*")
            # A function's body runs when it is called, not when the module loads.
            visit(child, top and not isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), True)
    return found


def _gateway_imports() -> list[tuple[str, str, bool]]:
    return [(str(path.relative_to(ROOT)), module, top) for path in GATEWAYS
            for module, top in imports(path.read_text(), ".".join(
                path.relative_to(ROOT).parent.parts))]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_walk_sees_every_form_of_import():
    source = ("from transfer import connector\nfrom ..router import probes\n"
              "from . import sse as s\nimport vllm.config\n"
              "def f():\n    import vllm\n    from .x import y\n"
              "class C:\n    from nixl import _api\n")
    assert imports(source, "services.edge") == [
        ("transfer", True), ("transfer.connector", True),
        ("services.router", True), ("services.router.probes", True),
        ("services.edge", True), ("services.edge.sse", True), ("vllm.config", True),
        ("vllm", False), ("services.edge.x", False), ("services.edge.x.y", False),
        ("nixl", True), ("nixl._api", True)]
    assert len(GATEWAYS) > 20                      # the globs found the services


def test_the_edge_and_the_router_import_no_transfer_module_but_the_contract():
    wrong = [(path, module) for path, module, _ in _gateway_imports()
             if _within(module, "transfer") and module != "transfer"
             and not _within(module, CONTRACT)]
    assert wrong == []
    assert any(_within(module, CONTRACT) for _, module, _ in _gateway_imports())


def test_the_edge_and_the_router_import_no_engine_stack_when_they_load():
    wrong = [(path, module) for path, module, top in _gateway_imports()
             if top and any(_within(module, stack) for stack in ENGINE_STACK)]
    assert wrong == []


def test_the_contract_imports_the_standard_library_alone():
    source = (ROOT / "transfer" / "params.py").read_text()
    roots = {module.split(".")[0] for module, _ in imports(source, "transfer")}
    assert roots <= set(sys.stdlib_module_names) | {"__future__"}, roots


def test_loading_the_edge_and_the_router_loads_neither_vllm_nor_the_connector():
    # A fresh interpreter: this one may hold vLLM from other tests.
    probe = ("import sys, services.edge.app, services.edge.server, services.router.server\n"
             "print(*sorted(m for m in sys.modules if m.split('.')[0] in "
             "('vllm', 'nixl', 'transfer')))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["transfer", CONTRACT]
