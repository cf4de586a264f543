"""Who may import what. One namespace: every module is `pdserve.*` (services/ and transfer/
are mapped into it), nothing imports a top-level `services` or `transfer`. The runtime never
imports the harness (`pdserve.bench`: benchmarks, chaos, the synthetic engine, launchers); only
the CLI's `bench` and `chaos` commands reach it, when run. Across the KV seam the edge and
the router know the `kv_transfer_params` contract (transfer/params.py) and no other part of
`transfer/` (the connector runs in vLLM's engine process), and load neither vLLM nor NIXL."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"pdserve": "pdserve", "services": "pdserve.services", "transfer": "pdserve.transfer"}
HARNESS = "pdserve.bench"
# The CLI's doors to the harness: imported inside the `bench` and `chaos` commands.
HARNESS_DOORS = {("pdserve.cli", "pdserve.bench.cli"), ("pdserve.cli", "pdserve.bench.chaos"),
                 ("pdserve.cli", "pdserve.bench.plan.cli")}
CONTRACT = "pdserve.transfer.params"
ENGINE_STACK = ("vllm", "nixl")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join((FOLDERS[parts[0]], *parts[1:])) if parts[0] in FOLDERS else ".".join(parts)
    return name.removesuffix(".__init__")


def sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py")
                  if "v1" not in p.relative_to(ROOT).parts[:2] and "node_modules" not in p.parts)


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


def imports_of(path: Path) -> list[tuple[str, bool]]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imports(path.read_text(), package)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


GATEWAYS = sources("services/edge", "services/router")
RUNTIME = [p for p in sources("pdserve", "services", "transfer")
           if not _within(module_name(p), HARNESS)]


def test_the_walk_sees_every_form_of_import():
    source = ("from pdserve.transfer import connector\nfrom ..router import probes\n"
              "from . import sse as s\nimport vllm.config\n"
              "def f():\n    import vllm\n    from .x import y\n"
              "class C:\n    from nixl import _api\n")
    assert imports(source, "pdserve.services.edge") == [
        ("pdserve.transfer", True), ("pdserve.transfer.connector", True),
        ("pdserve.services.router", True), ("pdserve.services.router.probes", True),
        ("pdserve.services.edge", True), ("pdserve.services.edge.sse", True),
        ("vllm.config", True), ("vllm", False), ("pdserve.services.edge.x", False),
        ("pdserve.services.edge.x.y", False), ("nixl", True), ("nixl._api", True)]
    assert module_name(ROOT / "services/edge/app.py") == "pdserve.services.edge.app"
    assert len(GATEWAYS) > 20 and len(RUNTIME) > 60         # the globs found the tree


def test_nothing_imports_a_top_level_services_or_transfer():
    wrong = [(str(p.relative_to(ROOT)), m) for p in sources(
                 "pdserve", "services", "transfer", "tests", "scripts")
             for m, _ in imports_of(p) if m.split(".")[0] in ("services", "transfer")]
    assert wrong == []


def _door(importer: str, module: str) -> bool:
    """`module` is a door of HARNESS_DOORS, or a name imported from one."""
    return any(importer == i and _within(module, d) for i, d in HARNESS_DOORS)


def test_the_runtime_never_imports_the_harness():
    wrong = [(module_name(p), m) for p in RUNTIME for m, _ in imports_of(p)
             if _within(m, HARNESS) and not _door(module_name(p), m)]
    assert wrong == []
    doors = {(module_name(p), m, top) for p in RUNTIME for m, top in imports_of(p)
             if _door(module_name(p), m)}
    assert doors and not any(top for _, _, top in doors)   # the doors open when run


def test_the_edge_and_the_router_import_no_transfer_module_but_the_contract():
    wrong = [(module_name(p), m) for p in GATEWAYS for m, _ in imports_of(p)
             if _within(m, "pdserve.transfer") and m != "pdserve.transfer"
             and not _within(m, CONTRACT)]
    assert wrong == []
    assert any(_within(m, CONTRACT) for p in GATEWAYS for m, _ in imports_of(p))


def test_the_edge_and_the_router_import_no_engine_stack_when_they_load():
    wrong = [(module_name(p), m) for p in GATEWAYS for m, top in imports_of(p)
             if top and any(_within(m, stack) for stack in ENGINE_STACK)]
    assert wrong == []


def test_the_contract_imports_the_standard_library_alone():
    roots = {m.split(".")[0] for m, _ in imports_of(ROOT / "transfer" / "params.py")}
    assert roots <= set(sys.stdlib_module_names) | {"__future__"}, roots


def test_loading_the_edge_and_the_router_loads_no_engine_stack_no_connector_no_harness():
    # A fresh interpreter: this one may hold vLLM from other tests.
    probe = ("import sys, pdserve.services.edge.app, pdserve.services.edge.server, "
             "pdserve.services.router.server\n"
             "print(*sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'nixl') "
             "or m.startswith(('pdserve.transfer', 'pdserve.bench'))))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["pdserve.transfer", CONTRACT]
