"""The import rules of docs/architecture.md, read from the source: packages import only the layers below them,
no file imports itself back around a loop, and function-level imports between project modules are reserved for
modules that pull in a heavy dependency (lm-eval, vLLM) or one a machine may lack (optuna: the lent GPU machine
has none, and everything but the search runs there) at import time."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("runtime", "quant", "specdec", "evals", "studies", "quantspec")  # each imports only those before it
HEAVY = ("vllm", "lm_eval", "compressed_tensors")  # dependencies costing seconds at import: a module may defer them
OPTIONAL = ("optuna",)  # missing on some machines: a module may defer it, so the rest imports without it
FRONT_DOORS = {"quantspec.cli": "quantspec"}  # the CLI is a thin layer over the public API: it imports only that


def modules(root: Path, packages=LAYERS) -> dict[str, ast.Module]:
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            out[name] = ast.parse(path.read_text(), str(path))
    return out


def imports(tree: ast.Module, known: dict) -> list[tuple[str, bool]]:
    """(imported project module, at function level) for every import in ``tree``."""
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out += [(name, id(node) in nested) for name in names if name in known]
    return out


def heavy_at_import(tree: ast.Module) -> bool:
    for node in tree.body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n.split(".")[0] in HEAVY + OPTIONAL for n in names):
            return True
    return False


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def violations(root: Path, packages=LAYERS, front_doors=FRONT_DOORS) -> list[str]:
    """Every broken rule, one line each."""
    mods = modules(root, packages)
    rank = {p: i for i, p in enumerate(packages)}
    edges, out = {}, []
    for name, tree in mods.items():
        targets = imports(tree, mods)
        edges[name] = {t for t, _ in targets if t != name and not name.startswith(t + ".")}
        for target, deferred in targets:
            if rank[target.split(".")[0]] > rank[name.split(".")[0]]:
                out.append(f"{name} imports {target}, a layer above it")
            door = next((d for d in front_doors if name == d or name.startswith(d + ".")), None)
            if door and target.split(".")[0] != front_doors[door]:
                out.append(f"{name} imports {target}: {door} goes through {front_doors[door]} only")
            if deferred and not heavy_at_import(mods[target]):
                out.append(f"{name} defers importing {target}, which loads no heavy or optional dependency: import it "
                           "at the top")
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(edges)]
    return out


def test_no_cycles_layers_respected_no_needless_deferred_imports():
    assert violations(ROOT) == []


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_negative_control_each_rule_catches_its_breach(tmp_path):
    layers = ("low", "high")
    write(tmp_path, {"low/__init__.py": "", "high/__init__.py": "", "low/heavy.py": "import vllm\n",
                     "low/a.py": "from low import b\n", "low/b.py": "import low.a\n",
                     "low/up.py": "from high.c import x\n", "high/c.py": "x = 1\n",
                     "high/lazy.py": "def f():\n    from low.up import y\n    from low.heavy import z\n",
                     "high/door/__init__.py": "", "high/door/cmd.py": "import high.c\nimport low.b\n"})
    found = violations(tmp_path, layers, {"high.door": "high"})
    assert "import cycle: low.a -> low.b" in found
    assert "low.up imports high.c, a layer above it" in found
    assert any(line.startswith("high.lazy defers importing low.up") for line in found)
    assert not any("low.heavy" in line for line in found)  # deferring a vLLM importer is allowed
    assert "high.door.cmd imports low.b: high.door goes through high only" in found  # the front door's rule
    assert len(found) == 4
