"""The import rules of docs/architecture.md, read from the source: packages import only the layers below them,
no file imports itself back around a loop, and function-level imports between project modules are reserved for
modules that pull in a heavy dependency (lm-eval, vLLM) or one a machine may lack (optuna: the lent GPU machine
has none, and everything but the search runs there) at import time. Backends are named only in ``serving``:
studies reach them through the registry and the ``Backend`` interface, never a concrete backend module, and no
module elsewhere branches on a backend's name."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("runtime", "quant", "specdec", "evals", "serving", "studies", "quantspec")  # each imports only those below
HEAVY = ("vllm", "lm_eval", "compressed_tensors")  # dependencies costing seconds at import: a module may defer them
OPTIONAL = ("optuna",)  # missing on some machines: a module may defer it, so the rest imports without it
FRONT_DOORS = {"quantspec.cli": "quantspec"}  # the CLI is a thin layer over the public API: it imports only that
# studies ask backends questions through the registry and the interface, never a concrete backend module
BACKEND_INTERFACE = {"studies": ("serving.backends", ("serving.backends", "serving.backends.base"))}
BACKEND_HOME = "serving"  # the only package that compares anything with a backend's name
BACKEND_NAMES = ("native", "vllm")


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


def parents(module: str) -> list[str]:
    """The packages whose ``__init__`` runs before ``module``: ``a.b.c`` -> ``a``, ``a.b``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def violations(root: Path, packages=LAYERS, front_doors=FRONT_DOORS) -> list[str]:
    """Every broken rule, one line each."""
    mods = modules(root, packages)
    rank = {p: i for i, p in enumerate(packages)}
    edges, out = {}, []
    for name, tree in mods.items():
        targets = imports(tree, mods)
        # importing a.b.c first runs a/__init__ and a/b/__init__ (what those import is part of the loop)
        loaded = {t for t, _ in targets} | {p for t, _ in targets for p in parents(t) if p in mods}
        edges[name] = {t for t in loaded if t != name and not name.startswith(t + ".")}
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


def backend_violations(root: Path, packages=LAYERS, interface=BACKEND_INTERFACE, home=BACKEND_HOME,
                       names=BACKEND_NAMES) -> list[str]:
    """A package of ``interface`` importing a module under its backends package other than the allowed ones
    (the registry and the base class), and, outside ``home``, a comparison with a backend's name
    (``x == "vllm"``, ``x != "native"``, ``x in ("vllm", ...)``): a branch that belongs to the Backend class."""
    mods = modules(root, packages)
    out = []
    for name, tree in mods.items():
        package = name.split(".")[0]
        if package in interface:
            under, allowed = interface[package]
            out += [f"{name} imports {target}, a concrete backend: ask the Backend class ({under})"
                    for target, _ in imports(tree, mods)
                    if target.startswith(under + ".") and target not in allowed]
        if package == home:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            values = [c for o in operands for c in ([o] if isinstance(o, ast.Constant) else
                                                     o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [])]
            hits = sorted({c.value for c in values if isinstance(c, ast.Constant) and c.value in names})
            out += [f"{name}:{node.lineno} compares with the backend name {hit!r}: ask the Backend class ({home})"
                    for hit in hits]
    return out


def test_no_cycles_layers_respected_no_needless_deferred_imports():
    assert violations(ROOT) == []


def test_backends_named_only_in_serving_and_studies_use_the_interface():
    assert backend_violations(ROOT) == []


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


def test_negative_control_a_loop_through_a_package_init_is_a_cycle(tmp_path):
    """``low.gen`` imports ``low.pkg.base`` (a leaf), but that runs ``low/pkg/__init__`` first, which imports
    ``low.pkg.engine``, which imports ``low.gen``: importing ``low.gen`` first fails (serving.loadgen did)."""
    write(tmp_path, {"low/__init__.py": "", "low/pkg/__init__.py": "from low.pkg import engine\n",
                     "low/pkg/base.py": "x = 1\n", "low/pkg/engine.py": "from low.gen import y\n",
                     "low/gen.py": "from low.pkg.base import x\ny = x\n"})
    assert violations(tmp_path, ("low",), {}) == ["import cycle: low.gen -> low.pkg -> low.pkg.engine"]
    (tmp_path / "low/gen.py").write_text("y = 1\n")  # the leaf moved out of the package: no loop
    assert violations(tmp_path, ("low",), {}) == []


def test_negative_control_backend_rules_catch_their_breaches(tmp_path):
    layers = ("low", "srv", "top")
    write(tmp_path, {"low/__init__.py": "", "srv/__init__.py": "", "top/__init__.py": "",
                     "srv/backends/__init__.py": "from srv.backends import base, fast\n",
                     "srv/backends/base.py": "class Backend:\n    pass\n",
                     "srv/backends/fast.py": "from srv.backends.base import Backend\n",
                     "srv/pick.py": "def pick(b):\n    return b == 'fast'\n",  # the home may name backends
                     "top/ok.py": "from srv.backends import base\nimport srv.backends\n",
                     "top/concrete.py": "from srv.backends.fast import Backend\n",
                     "top/branch.py": "def f(c):\n    return c.backend != 'fast'\n",
                     "top/member.py": "def f(c):\n    return 'slow' in c or c in ['x', 'slow']\n",
                     "low/flipped.py": "def f(c):\n    return 'fast' == c\n",
                     "low/other.py": "def f(c):\n    return c == 'fastest' or c.kind == 'none'\n"})
    found = backend_violations(tmp_path, layers, {"top": ("srv.backends", ("srv.backends", "srv.backends.base"))},
                               "srv", ("fast", "slow"))
    assert "top.concrete imports srv.backends.fast, a concrete backend: ask the Backend class (srv.backends)" in found
    assert any(line.startswith("top.branch:2 compares with the backend name 'fast'") for line in found)
    assert any(line.startswith("top.member:2 compares with the backend name 'slow'") for line in found)
    assert any(line.startswith("low.flipped:2 compares with the backend name 'fast'") for line in found)
    assert not any(line.startswith(("top.ok", "srv.", "low.other")) for line in found)
    assert len(found) == 5  # top.member: two comparisons (a bare constant, a list element), one line each


# libraries the CLI's start does not load: each costs ~0.7-2 s (torch._dynamo 1.9 s, scipy.stats 0.7 s), paid by
# every `quantspec` command, --help and one-line errors included (5.7 s to `import quantspec` with them, 1.6 without)
NOT_AT_START = ("torch._dynamo", "torch._inductor", "scipy.stats", "vllm", "lm_eval", "compressed_tensors", "optuna",
                "transformers", "matplotlib")


def loaded_at_start(extra: str = "") -> list[str]:
    """Which of ``NOT_AT_START`` a fresh interpreter holds after ``import quantspec.cli`` (and ``extra``)."""
    code = (f"import json, sys, quantspec.cli{extra}; "
            f"print(json.dumps([m for m in {NOT_AT_START!r} if m in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_cli_starts_without_the_heavy_libraries():
    """Negative control: a module importing scipy.stats at its top (as specdec.lossless did) is caught."""
    assert loaded_at_start() == []
    assert loaded_at_start(", specdec.lossless, scipy.stats") == ["scipy.stats"]
