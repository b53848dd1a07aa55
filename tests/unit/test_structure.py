"""The shape of the source, read with `ast`: the layer order README.md writes down (an import goes
down or sideways, never up, and never in a circle), no function over 80 lines, and no mode flag
deciding a kernel's form."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ds4tvm"
MAX_LINES = 80


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """ds4tvm module -> the ds4tvm modules it imports (at module level or inside functions)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in paths and t != name)
        graph[name] = deps
    return graph


def readme_layers() -> dict[str, int]:
    """README's layer order: the line `errors, cache < gguf, ... < cli` of its Layout section, each
    `<` one layer up; a name is a top-level module or package of ds4tvm."""
    text = (ROOT / "README.md").read_text()
    line = next(ln for ln in text.splitlines() if re.match(r"^\s*errors, cache <", ln))
    return {name.strip(): i for i, layer in enumerate(line.split("<")) for name in layer.split(",")}


def _layer_of(module: str, layers: dict[str, int]) -> int:
    top = module.split(".")[1] if "." in module else "errors"   # the package's own __init__: __version__ only
    assert top in layers, f"{module}: its top-level name {top!r} is in no layer of README's Layout section"
    return layers[top]


def upward_imports(graph: dict, layers: dict) -> list[str]:
    return [f"{m} -> {d}" for m, deps in graph.items() for d in deps if _layer_of(d, layers) > _layer_of(m, layers)]


def import_cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_goes_up_a_layer():
    assert not upward_imports(import_graph(), readme_layers())


def test_no_import_cycle():
    assert not import_cycles(import_graph())


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The two checks above on a graph that breaks both, and the graph read from the source with
    its relative imports resolved (they would pass on anything otherwise)."""
    bad = {"ds4tvm.nn.a": {"ds4tvm.nn.b"}, "ds4tvm.nn.b": {"ds4tvm.nn.a", "ds4tvm.runtime.c"},
           "ds4tvm.runtime.c": set()}
    assert upward_imports(bad, readme_layers()) == ["ds4tvm.nn.b -> ds4tvm.runtime.c"]
    assert import_cycles(bad) == [["ds4tvm.nn.a", "ds4tvm.nn.b"]]
    graph = import_graph()
    assert "ds4tvm.kernels.cpu" in graph["ds4tvm.nn.qweight"]
    assert "ds4tvm.families.contract" in graph["ds4tvm.families.deepseek4.build"]


def test_no_function_over_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_no_mode_flag_decides_a_kernel_form():
    """Kernel forms come from kernels/forms.Forms passed down, not from a ContextVar or a global set
    around the export."""
    found = []
    for path in sorted([*(PACKAGE / "nn").rglob("*.py"), *(PACKAGE / "kernels").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                    "contextvars" in (a.name or "") for a in node.names) or \
                    isinstance(node, ast.ImportFrom) and node.module == "contextvars":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports contextvars")
            if isinstance(node, ast.Global):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: global {', '.join(node.names)}")
    assert not found, found
