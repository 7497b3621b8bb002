"""The package's layers, read from its source: no module imports one that imports it back (at the top or inside a
function), and the low layers import nothing above them, so each can be read, tested and replaced on its own."""
import ast
from pathlib import Path

import fastdecode

ROOT = Path(fastdecode.__file__).parent
FOUNDATION = {"errors", "config", "memory", "private_files"}  # plain modules every layer may use
# package -> the packages it may import besides itself and FOUNDATION
BELOW = {
    "kernels": set(),
    "layers": set(),
    "models": {"layers"},
    "runners": {"kernels", "layers", "models", "quant"},
}


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports() -> dict[str, set[str]]:
    """module -> the fastdecode modules it imports anywhere in its text (`from package import name` counts as the
    submodule `name` where there is one, else as the package)."""
    mods = modules()

    def owner(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base] * bool(base))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            found |= {owner(n) for n in names if n.split(".")[0] == "fastdecode"}
        graph[module] = found - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

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
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(imports()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_low_layers_import_nothing_above_them():
    wrong = sorted(f"{m} imports {t}" for m, targets in imports().items() if part(m) in BELOW
                   for t in targets if part(t) not in BELOW[part(m)] | FOUNDATION | {part(m)})
    assert wrong == []
