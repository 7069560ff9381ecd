"""The package's shape: no import cycles (lazy imports included: a lazy import that dodges a
cycle is still a cycle), no library module over 400 lines and no CLI command over 100, the Linux
CPU backend behind its one seam (``mlxspec.cpu``), and a cheap ``import mlxspec``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Where each installed package lives in the checkout (pyproject's package-dir).
PACKAGE_DIRS = {"mlxspec": ROOT / "mlxspec", "mlxspec.cli": ROOT / "cli"}
MAX_LINES = 400  # a library module past this is split by concern
MAX_COMMAND_LINES = 100  # a CLI command parses, calls one library function and renders



def _modules() -> dict[str, Path]:
    modules = {}
    for package, directory in PACKAGE_DIRS.items():
        for path in directory.rglob("*.py"):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "mlxspec" and parts[:1] == ["cli"]:
                continue
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """mlxspec modules that ``module`` imports anywhere (functions included), except under
    ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for top in ast.walk(tree) if isinstance(top, ast.If)
               and _is_type_checking(top) for n in ast.walk(top)}
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")
                parent = parent[: len(parent) - node.level + (1 if is_package else 0)]
                base = ".".join(parent + ([base] if base else []))
            # an imported submodule is the edge; an imported function is an edge to its module
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                     for alias in node.names]
        for name in names:
            # the longest known module the name refers to (a.b.c -> a.b if c is a function)
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and name != "mlxspec":
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, m, modules) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    sys.setrecursionlimit(10_000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_sees_the_package():
    graph = _graph()
    assert "mlxspec.evaluation.flow" in graph and "mlxspec.cli.quantize" in graph
    assert "mlxspec.evaluation.metrics" in graph["mlxspec.evaluation.flow"]
    assert "mlxspec.publish.quantize_flow" in graph["mlxspec.cli.quantize"]  # an import in a function


def test_no_import_cycles():
    cycles = [sorted(c) for c in _cycles(_graph())]
    assert not cycles, f"import cycles: {cycles}"


def test_library_modules_stay_small():
    too_long = {m: n for m, p in _modules().items() if not m.startswith("mlxspec.cli")
                and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not too_long, f"split these modules: {too_long}"


def _command_modules() -> list[str]:
    from mlxspec.cli.main import COMMANDS

    return [f"mlxspec.cli.{name.replace('-', '_')}" for name in COMMANDS]


def test_cli_commands_stay_thin():
    modules = _modules()
    assert len(_command_modules()) >= 10
    too_long = {m: n for m in _command_modules()
                if (n := len(modules[m].read_text().splitlines())) > MAX_COMMAND_LINES}
    assert not too_long, f"move the flow of these commands into the library: {too_long}"
    helpers = {m: n for m, p in modules.items() if m.startswith("mlxspec.cli")
               and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not helpers, f"split these CLI modules: {helpers}"


def test_the_cpu_backend_is_reached_through_its_seam_only():
    """No module outside ``mlxspec/cpu/`` imports one of its modules: the rest of the library
    (and the CLI) calls the functions of ``mlxspec.cpu`` itself."""
    graph = _graph()
    internals = {m for m in graph if m.startswith("mlxspec.cpu.")}
    assert {"mlxspec.cpu.blas", "mlxspec.cpu.ops", "mlxspec.cpu.jit"} <= internals
    crossing = {m: sorted(graph[m] & internals) for m in graph
                if not (m == "mlxspec.cpu" or m.startswith("mlxspec.cpu.")) and graph[m] & internals}
    assert not crossing, f"import mlxspec.cpu and call its functions instead: {crossing}"
    assert "mlxspec.cpu" in graph["mlxspec.load"]  # load prepares the backend through the seam


def test_each_subsystem_is_a_package():
    """The tree reads as the architecture: no top-level module named for a subsystem's part
    (``engine_*``, ``gguf_*``, ``cpu_*``...): those live in their packages."""
    top = sorted(p.stem for p in (ROOT / "mlxspec").glob("*.py"))
    prefixed = [m for m in top if m.split("_")[0] in
                {"engine", "gguf", "cpu", "blas", "batch", "serve", "openai", "card", "hub"}]
    assert not prefixed, f"move these into their package: {prefixed}"
    for package in ("cpu", "gguf", "serving", "publish", "quant", "speculative", "evaluation"):
        assert (ROOT / "mlxspec" / package / "__init__.py").is_file()
    assert len(top) <= 20, f"{len(top)} top-level modules: group them by concern"


def _imported_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
        capture_output=True, text=True, check=True, env=os.environ.copy(),
    ).stdout.split()
    return {m for m in ("mlx.core", "mlx_lm", "transformers", "numpy") if m in out}


def test_import_mlxspec_and_the_cli_load_no_heavy_module():
    """`import mlxspec` and `mlxspec --help` (all commands registered) stay cheap: mlx, mlx-lm
    and transformers load on first use."""
    assert _imported_after("import mlxspec") == set()
    assert _imported_after("from mlxspec.cli.main import cli\n"
                           "cli.main(['--help'], standalone_mode=False)") == set()


def test_public_names_are_the_functions_even_after_their_modules_load():
    import mlxspec
    from mlxspec.generate import stream_generate  # loads the submodules mlxspec.load/generate
    from mlxspec.load import resolve_model_path  # noqa: F401

    assert callable(mlxspec.load) and mlxspec.load.__module__ == "mlxspec.load"
    assert mlxspec.generate.__module__ == "mlxspec.generate"
    assert mlxspec.stream_generate is stream_generate
    assert set(mlxspec.__all__) <= set(dir(mlxspec))
    for name in mlxspec.__all__:
        assert getattr(mlxspec, name) is not None
