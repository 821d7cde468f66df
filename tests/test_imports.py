"""The import graph of ``src/simple_sampler`` runs downward only, with no
cycle (docs/INTERNALS.md, "Layers").

Every import of one of our modules counts, at module level or inside a
function (a function-local import hides a cycle from Python, not from this
test). A module may import modules of its own layer or of a lower one:

    base     params, settings, schema, logs, sampling, handoff, shvs/,
             reference, baselines, rows, models, row_arena, row_reader, pids, heap, stacks (and the package itself)
    serving  serving/: the llm process's engine room, no Triton
    triton   triton/: code that runs inside Triton's models
    client   client/: the generate clients
    frontend frontend/: the OpenAI-compatible API (a client of llm; serve starts it)
    launch   launch/: the launcher (finds, assembles, starts, supervises)
    tools    bench/, report
    cli      cli
"""
import ast
from pathlib import Path

import pytest

PACKAGE = "simple_sampler"
ROOT = Path(__file__).resolve().parents[1] / "src" / PACKAGE

LAYERS = (
    ("base", ("params", "histories", "settings", "schema", "logs", "sampling", "handoff", "shvs", "reference",
              "baselines", "rows", "models", "_sampling", "row_arena", "row_reader", "pids", "heap", "stacks",
              "host_copy", "addresses")),
    ("serving", ("serving",)),
    ("triton", ("triton",)),
    ("client", ("client",)),
    ("frontend", ("frontend",)),
    ("launch", ("launch",)),
    ("tools", ("bench", "report")),
    ("cli", ("cli", "console")),
)
RANK = {part: rank for rank, (_, parts) in enumerate(LAYERS) for part in parts}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def own_imports(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The modules of ours that `path` imports anywhere in its body."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules
            # `from package import module` imports the module, not the package
            found.update(submodules or {base})
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    paths = sorted(root.rglob("*.py"))
    compiled = {f"{PACKAGE}.{p.name.split('.')[0]}" for p in root.glob("*.so")}  # _sampling
    modules = {module_name(p, root) for p in paths} | compiled
    return {module_name(p, root): own_imports(p, modules, root) for p in paths}


def layer_rank(module: str) -> int:
    """The layer of a module; the package itself is base."""
    parts = module.split(".")
    return RANK[parts[1]] if len(parts) > 1 else 0


def upward_edges(graph: dict[str, set[str]], rank=layer_rank) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if rank(b) > rank(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a
    module importing itself), by Tarjan's algorithm."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_every_module_has_a_layer():
    graph = import_graph()
    assert len(graph) > 40
    unplaced = [m for m in graph if len(m.split(".")) > 1 and m.split(".")[1] not in RANK]
    assert not unplaced, f"add these to LAYERS (and docs/INTERNALS.md): {unplaced}"


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_imports_run_downward_only():
    assert upward_edges(import_graph()) == []


def test_the_checker_finds_a_cycle_and_an_upward_edge(tmp_path):
    package = tmp_path / PACKAGE
    (package / "serving").mkdir(parents=True)
    (package / "triton").mkdir()
    files = {
        "__init__.py": "",
        "params.py": "from .settings import X\n",
        "settings.py": "def check():\n    from .triton.pool import parse  # upward, hidden in a function\n",
        "serving/__init__.py": "",
        "serving/a.py": "from . import b\n",
        "serving/b.py": "from .a import f\n",
        "triton/__init__.py": "",
        "triton/pool.py": "from ..params import Y\nimport simple_sampler.serving.a\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    assert graph["simple_sampler.triton.pool"] == {"simple_sampler.params",
                                                   "simple_sampler.serving.a"}
    assert cycles(graph) == [["simple_sampler.params", "simple_sampler.settings",
                              "simple_sampler.triton.pool"],
                             ["simple_sampler.serving.a", "simple_sampler.serving.b"]]
    assert upward_edges(graph) == [("simple_sampler.settings", "simple_sampler.triton.pool")]


@pytest.mark.parametrize("module", ["simple_sampler.settings", "simple_sampler.serving.engines"])
def test_the_light_modules_import_no_torch(module):
    """settings and the engine registry are read by the CLI parser and the
    launcher: neither may pull torch (or TensorRT-LLM) in."""
    import subprocess
    import sys

    code = (f"import sys, {module}; heavy = [m for m in ('torch', 'tensorrt_llm') "
            f"if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_sampler_model_starts_without_torch():
    """The sampler model's modules (backends/simple_sampler/model.py) leave
    torch unimported: each instance would spend seconds of CPU importing it
    as it starts, for nothing (its inputs are numpy; a BF16 input, where the
    config has one, brings torch in for DLPack)."""
    import subprocess
    import sys

    probe = ("import sys; import simple_sampler.triton.sampler_serve, simple_sampler.row_arena, "
             "simple_sampler.shvs.hot_vocab, simple_sampler.triton.counters, "
             "simple_sampler.triton.stub_profile, simple_sampler.settings, simple_sampler.logs; "
             "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
