"""The package's import graph is layered and circle-free, file by file.

Why: a file-level circle means no file of it can be understood, tested or moved alone, and an import that reaches
up the stack (a model importing the trainer) drags the whole framework into a low-level test. Both creep in
silently because Python tolerates them (lazy imports inside functions hide them from import-time errors), so this
reads every import statement of every file with ``ast`` (function bodies and ``if TYPE_CHECKING`` blocks
included) and checks the graph itself.

A module may import modules of its own layer or of lower ones (``LAYERS``, bottom first); a circle is refused even
inside one layer.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

PACKAGE = "mmrlhf"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

# Bottom to top. An entry names a module or a package (covering everything under it); a module belongs to the
# layer of its longest matching entry, and every module must belong to one. An entry may name a package that does
# not exist (yet): it covers nothing.
LAYERS: list[tuple[str, ...]] = [
    ("mmrlhf.config",),
    ("mmrlhf.registry", "mmrlhf.devices", "mmrlhf.startup", "mmrlhf.proofs"),
    # The rank / world object with its collectives (one process is a world of one rank).
    ("mmrlhf.parallel",),
    ("mmrlhf.data",),
    ("mmrlhf.models",),
    ("mmrlhf.algorithms",),
    ("mmrlhf.rollout",),
    ("mmrlhf.agents",),
    ("mmrlhf.rewards",),
    ("mmrlhf.experience",),
    ("mmrlhf.tasks",),
    ("mmrlhf.trainer",),
    # The toolbox for tests and the doctor: tiny models, engine checks, and the doctor, which builds a trainer
    # (trainer.builder); the doctor command (cli) imports it.
    ("mmrlhf.testing",),
    # Launching a run: single process, torchrun, Ray; only the cli imports it.
    ("mmrlhf.launch",),
    ("mmrlhf.cli", "mmrlhf.__main__"),
]


# --------------------------------------------------------------------------------------------------- the reader


def module_name(path: Path, package_dir: Path) -> str:
    """``<root>/mmrlhf/a/b.py`` -> ``mmrlhf.a.b``; a package's ``__init__.py`` -> the package's name."""
    parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _known(name: str, modules: set[str]) -> str | None:
    """The longest prefix of dotted ``name`` that is one of ``modules`` (None outside them)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(tree: ast.AST, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the file of module ``name`` imports anywhere in it.

    ``from p import x`` counts as an import of ``p`` (Python runs it first: a package's ``__init__``) and of ``p.x``
    where that is a module; relative imports are resolved against the file's package.
    """
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, modules)
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            # Python runs ``source`` itself (a package's __init__) before taking ``x`` from it
            targets = {_known(source, modules), *(_known(f"{source}.{a.name}", modules) for a in node.names)}
            found.update(target for target in targets if target)
    found.discard(name)
    return found


def read_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, for every ``.py`` file under ``package_dir``."""
    files = {module_name(path, package_dir): path for path in sorted(package_dir.rglob("*.py"))}
    modules = set(files)
    return {
        name: imports_of(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", modules)
        for name, path in files.items()
    }


# ------------------------------------------------------------------------------------------------- the checks


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def _shortest_cycle(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
    """The shortest path ``start -> ... -> start`` inside ``members`` (breadth first)."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph.get(node, ())):
            if child not in members:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is on no cycle")


def find_cycles(graph: dict[str, set[str]]) -> list[str]:
    """One readable chain ``a -> b -> a`` per circle (strongly connected group of files), with the group's size."""
    report = []
    for members in _components(graph):
        chain = _shortest_cycle(graph, members[0], set(members))
        others = len(members) - len(chain) + 1
        tail = f" (the circle takes in {others} more: {', '.join(sorted(set(members) - set(chain)))})" if others else ""
        report.append(" -> ".join(chain) + tail)
    return report


def layer_of(module: str, layers: list[tuple[str, ...]]) -> int | None:
    """The index of the layer whose longest entry is a prefix (by dotted parts) of ``module``."""
    best: tuple[int, int] | None = None
    for level, entries in enumerate(layers):
        for entry in entries:
            if module == entry or module.startswith(entry + "."):
                if best is None or len(entry) > best[0]:
                    best = (len(entry), level)
    return None if best is None else best[1]


def find_upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    """``a imports b`` for every import of a higher layer's module, plus every module no layer covers."""
    report = []
    for module in sorted(graph):
        if "." not in module:  # the root package: it must import nothing (test_root_package_imports_nothing)
            continue
        level = layer_of(module, layers)
        if level is None:
            report.append(f"{module} is in no layer")
            continue
        for target in sorted(graph[module]):
            target_level = layer_of(target, layers)
            if target_level is not None and target_level > level:
                names = " | ".join(layers[level]), " | ".join(layers[target_level])
                report.append(f"{module} ({names[0]}) imports {target} ({names[1]})")
    return report


# -------------------------------------------------------------------------------------------- the real package


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return read_graph(PACKAGE_DIR)


def test_no_import_cycle(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles between files:\n" + "\n".join(cycles)


def test_layer_contract(graph):
    upward = find_upward_imports(graph, LAYERS)
    assert not upward, "imports against the layer order (bottom first: see LAYERS):\n" + "\n".join(upward)


def test_root_package_imports_nothing(graph):
    # ``mmrlhf/__init__.py`` runs before any of its modules: an import there would put every file on a circle.
    assert graph[PACKAGE] == set()


# ------------------------------------------------------------------------------ controls: the checker can fail


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_reader_counts_every_import_form(tmp_path):
    package = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import os\nfrom pkg import b\nfrom pkg.c import Name\n",
        "pkg/b.py": "def later():\n    import pkg.sub.x\n",  # a lazy import inside a function
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import x as y\n",
        "pkg/sub/__init__.py": "from .x import thing\n",  # relative, from a package's __init__
        "pkg/sub/x.py": "from ..c import Name\nfrom . import y\nthing = 1\n",  # relative, two levels and one
        "pkg/sub/y.py": "from pkg import sub\n",  # the package itself
    })
    assert read_graph(package) == {
        "pkg": set(),
        "pkg.a": {"pkg", "pkg.b", "pkg.c"},  # ``from pkg import b`` runs pkg's __init__ too
        "pkg.b": {"pkg.sub.x"},
        "pkg.c": {"pkg.sub", "pkg.sub.x"},
        "pkg.sub": {"pkg.sub.x"},
        "pkg.sub.x": {"pkg.c", "pkg.sub", "pkg.sub.y"},
        "pkg.sub.y": {"pkg", "pkg.sub"},
    }


def test_a_package_init_that_re_exports_a_module_importing_it_back_is_a_circle(tmp_path):
    """``from pkg import sibling`` inside a module that pkg's __init__ re-exports runs that __init__ again: a circle
    (the shape the reward registry once had: rewards/__init__ -> engine -> sources -> functions -> rewards)."""
    package = _write(tmp_path, {
        "pkg/__init__.py": "from pkg.engine import Engine\n",
        "pkg/engine.py": "from pkg.functions import table\nclass Engine: ...\n",
        "pkg/functions.py": "from pkg import rules\ntable = rules\n",
        "pkg/rules.py": "",
    })
    cycles = find_cycles(read_graph(package))
    assert len(cycles) == 1 and "pkg.functions" in cycles[0] and "pkg.engine" in cycles[0], cycles


def test_a_lazy_import_closing_a_circle_is_reported(tmp_path):
    package = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import f\n",
        "pkg/b.py": "def f():\n    from pkg import a\n    return a\n",
    })
    assert find_cycles(read_graph(package)) == ["pkg.a -> pkg.b -> pkg.a"]


def test_cycles_are_reported_as_chains():
    assert find_cycles({"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": set(), "p.d": {"p.a", "p.c"}}) == []
    assert find_cycles({"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}) == ["p.a -> p.b -> p.c -> p.a"]
    assert find_cycles({"p.a": {"p.b", "p.c"}, "p.b": {"p.a"}, "p.c": {"p.a"}}) == [
        "p.a -> p.b -> p.a (the circle takes in 1 more: p.c)"
    ]


def test_upward_imports_and_unplaced_modules_are_reported():
    layers = [("p.low",), ("p.mid", "p.side"), ("p.high",)]
    graph = {
        "p": {"p.high"},  # the root package is checked on its own (test_root_package_imports_nothing)
        "p.low.m": {"p.low.n", "p.mid.k"},  # same layer: fine; upward: reported
        "p.low.n": set(),
        "p.mid.k": {"p.low.m", "p.side"},  # downward and a peer of its layer: fine
        "p.side": set(),
        "p.high": {"p.mid.k", "p.low.n"},
        "p.stray": {"p.low.n"},
    }
    assert find_upward_imports(graph, layers) == [
        "p.low.m (p.low) imports p.mid.k (p.mid | p.side)",
        "p.stray is in no layer",
    ]


def test_a_module_takes_the_layer_of_its_longest_entry():
    layers = [("p.a.b",), ("p.a",), ("p.missing",)]  # an entry naming no module is allowed
    assert layer_of("p.a.b.c", layers) == 0
    assert layer_of("p.a.c", layers) == 1
    assert layer_of("p.ab", layers) is None  # prefixes count by dotted parts, not characters
