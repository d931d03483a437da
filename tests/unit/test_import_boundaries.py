"""One adapter layer: the import rules of docs/DESIGN.md section 2, checked on every module of the
package with ``ast``.

1. Only ``sparsebalance_megatron/megatron/`` imports ``megatron``, and no other module imports our
   ``.megatron`` subpackage, at module level or inside a function (a Megatron indexed data set is
   parsed with numpy, ``data/indexed.py``).
2. Only ``sparsebalance_megatron/megatron/runtime/comm.py`` imports ``torch.distributed`` (other adapter
   modules may use Megatron's own distributed helpers), and only it touches ``torch.distributed.*``.
3. ``import sparsebalance_megatron`` and every pure subpackage (every one but ``megatron``) with all
   of its modules import in a fresh interpreter without ``megatron`` entering ``sys.modules``
   (one interpreter imports them all in turn: none of them pulls megatron in together, so none
   does alone).
4. No import circle between the package's modules. Imports inside functions count as much as
   module-level ones (a lazy import hides a circle from Python, not from the reader); imports
   under ``if TYPE_CHECKING:`` do not (they never run). ``from pkg import mod`` is an edge to the
   module ``pkg.mod`` only: a package's ``__init__`` importing its children is how packages work.
   A circle fails the test, named module by module with the line of each import.
5. The adapter's rooms (``megatron/<room>/``, docs/DESIGN.md section 2) import only the rooms
   before them in ``ROOM_ORDER`` (``errors`` is the leaf every room may import); the entries
   (``hooks``, ``profile_cli``) may import every room.
6. A room's ``__init__`` exports (lazily, ``_PUBLIC``) only names its modules define.

Modules are discovered, so new files are checked too. A current module that breaks a rule is a
single xfail case that names the file (KNOWN_VIOLATIONS); it is reported, not edited here.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "sparsebalance_megatron"
ADAPTER = PKG / "megatron"
COMM = ADAPTER / "runtime/comm.py"
KNOWN_VIOLATIONS: dict = {}
ROOM_ORDER = ["errors", "runtime", "model", "launch", "step"]   # each imports only those before


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


MODULES = sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(absolute module name, line, inside a function) for every import; ``from X import y``
    yields X and X.y (y may be a submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node, in_func):
        for child in ast.iter_child_nodes(node):
            f = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_func) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module
                out.append((mod, child.lineno, in_func))
                out.extend((f"{mod}.{a.name}", child.lineno, in_func) for a in child.names)
            visit(child, f)

    visit(tree, False)
    return out


def _type_checking(node) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def import_edges(path: Path, known: set) -> list[tuple[str, int]]:
    """(module of the package, line) for every import of ``path`` that runs (module level or in
    a function; not under ``if TYPE_CHECKING:``) and names a module in ``known``; ``from X
    import y`` is an edge to ``X.y`` where that is a module, else to ``X``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def deepest(mod: str):
        while mod and mod not in known:
            mod = mod.rpartition(".")[0]
        return mod or None

    out = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                for other in child.orelse:
                    visit(ast.Module(body=[other], type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                out.extend((deepest(a.name), child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module
                for a in child.names:
                    out.append((f"{mod}.{a.name}" if f"{mod}.{a.name}" in known
                                else deepest(mod), child.lineno))
            visit(child)

    visit(tree)
    return [(m, line) for m, line in out if m is not None and m != name]


def import_circles(paths, groups: list = None, edges=None) -> list[list[tuple[str, int]]]:
    """One import circle per group of modules that import each other (a strongly connected
    component), the shortest through the group's first module, each as [(module, line of its
    import of the next one), ...], the last importing the first. ``groups`` (a list) receives
    each group's modules: fixing one circle may leave another in the same group. ``edges``:
    the (module, line) imports of a path (default ``import_edges``; ``test_floors`` adds
    importlib's loads)."""
    files = {module_name(p): p for p in paths}
    graph = {name: {} for name in files}
    for name, path in files.items():
        for mod, line in (edges or import_edges)(path, set(files)):
            graph[name].setdefault(mod, line)
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):                       # Tarjan's algorithm, without recursion
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.add(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(group)
    circles = []
    for group in found:                              # one shortest circle through the group
        if groups is not None:
            groups.append(sorted(group))
        start = min(group)
        prev, frontier = {start: None}, [start]
        while frontier and start not in [w for v in frontier for w in graph[v] if w in group]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in group and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        path = [last]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        path.reverse()
        circles.append([(v, graph[v][path[(i + 1) % len(path)]]) for i, v in enumerate(path)])
    return circles


def describe(circle) -> str:
    return " -> ".join(f"{m.removeprefix('sparsebalance_megatron.')} (line {line})"
                       for m, line in circle) + " -> " + \
        circle[0][0].removeprefix("sparsebalance_megatron.")


def _is(name: str, top: str) -> bool:
    return name == top or name.startswith(top + ".")


def _param(rule: str, path: Path):
    reason = KNOWN_VIOLATIONS.get((rule, rel(path)))
    marks = [pytest.mark.xfail(reason=reason, strict=False)] if reason else []
    return pytest.param(path, id=rel(path), marks=marks)


def test_the_walk_sees_the_package():
    names = {rel(p) for p in MODULES}
    assert "sparsebalance_megatron/config.py" in names and rel(COMM) in names
    assert any(_is(m, "torch.distributed") for m, _, _ in imports(COMM)), "comm.py changed?"


@pytest.mark.parametrize("path", [_param("megatron", p) for p in MODULES
                                  if ADAPTER not in p.parents])
def test_only_the_adapter_imports_megatron(path):
    bad = []
    for mod, line, in_func in imports(path):
        if _is(mod, "megatron"):
            bad.append(f"line {line}: imports {mod}")
        elif _is(mod, "sparsebalance_megatron.megatron"):
            bad.append(f"line {line}: imports {mod}" + (" inside a function" if in_func else
                                                         " at module level"))
    assert not bad, f"{rel(path)}: " + "; ".join(bad)


@pytest.mark.parametrize("path", [_param("torch.distributed", p) for p in MODULES if p != COMM])
def test_only_comm_imports_torch_distributed(path):
    bad = [f"line {line}: imports {mod}" for mod, line, _ in imports(path)
           if _is(mod, "torch.distributed")]
    assert not bad, f"{rel(path)}: " + "; ".join(bad)


@pytest.mark.parametrize("path", [_param("torch.distributed attribute", p) for p in MODULES
                                  if p != COMM])
def test_only_comm_touches_torch_distributed(path):
    tree = ast.parse(path.read_text())
    bad = [f"line {n.lineno}: torch.distributed.{getattr(n, 'attr', '')}"
           for n in ast.walk(tree)
           if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
           and n.value.attr == "distributed" and isinstance(n.value.value, ast.Name)
           and n.value.value.id == "torch"]
    assert not bad, f"{rel(path)}: " + "; ".join(bad)


PURE = ["sparsebalance_megatron"] + sorted(
    module_name(p) for p in PKG.iterdir()
    if (p.is_dir() and (p / "__init__.py").exists() and p.name != "megatron")
    or (p.suffix == ".py" and p.name != "__init__.py"))

# One fresh interpreter imports every pure package in turn with all its modules: megatron absent
# from sys.modules after all of them is absent after each alone (the modules each runs are a part
# of what all run), at the CPU of one interpreter instead of one a package. Each package's result:
# what it imported and the megatron modules first imported during it, each with the module that
# imported it (a finder on sys.meta_path sees every import), or its import's traceback.
_CHECK = r"""
import importlib, json, pkgutil, sys, traceback
seen = {}
class Watch:
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "megatron" or fullname.startswith(("megatron.", "sparsebalance_megatron.megatron")):
            f = sys._getframe(1)
            while f is not None and f.f_code.co_filename.startswith("<frozen"):
                f = f.f_back
            seen.setdefault(fullname, f.f_globals.get("__name__") if f is not None else "?")
        return None
sys.meta_path.insert(0, Watch())
out = {}
for name in sys.argv[1:]:
    names, before = [name], set(seen)
    try:
        mod = importlib.import_module(name)
        if hasattr(mod, "__path__") and name != "sparsebalance_megatron":  # the root: itself only
            for info in pkgutil.walk_packages(mod.__path__, name + "."):
                if info.name.rsplit(".", 1)[-1] != "__main__":
                    importlib.import_module(info.name)
                    names.append(info.name)
        out[name] = {"imported": names, "megatron": sorted(f"{m} (imported by {seen[m]})" for m in set(seen) - before)}
    except Exception:
        out[name] = {"error": traceback.format_exc()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> dict:
    """Every pure (sub)package imported with all its modules, in one fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", _CHECK, *PURE], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pure_list_covers_the_named_subpackages():
    for name in ("attention", "latency", "quality", "sim", "policy", "batching", "data", "plan",
                 "config", "arguments"):
        assert f"sparsebalance_megatron.{name}" in PURE


@pytest.mark.parametrize("name", PURE)
def test_pure_packages_import_without_megatron(name, fresh_imports):
    result = fresh_imports[name]
    assert "error" not in result, f"import {name} failed:\n{result.get('error', '')[-3000:]}"
    assert name in result["imported"]
    assert result["megatron"] == [], f"importing {name} pulled in {result['megatron'][:5]}"


def test_no_import_circle_in_the_package():
    groups: list = []
    circles = import_circles(MODULES, groups)
    assert not circles, "import circles (each module imports the next, at that line): " + \
        "; ".join(f"{describe(c)} (in a group of {len(g)}: {', '.join(g)})"
                  for c, g in zip(circles, groups))


def _write(root: Path, files: dict) -> list[Path]:
    for rel_path, text in files.items():
        (root / rel_path).parent.mkdir(parents=True, exist_ok=True)
        (root / rel_path).write_text(text)
    return sorted(root.rglob("*.py"))


def test_the_circle_check_finds_a_circle_through_a_lazy_import(tmp_path, monkeypatch):
    """The check itself: a circle closed by a function-level relative import is found and named;
    a package ``__init__`` re-exporting a child that imports a sibling is not a circle, and
    neither is an import under ``if TYPE_CHECKING:``."""
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    paths = _write(tmp_path, {
        "pkg/__init__.py": "from .b import thing\n",
        "pkg/a.py": "from .b import thing\n",
        "pkg/b.py": "thing = 1\n\ndef f():\n    from . import c\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n"
                    "import pkg.a\n",
        "pkg/d.py": "from . import b\n"})
    circles = import_circles(paths)
    assert [[m for m, _ in c] for c in circles] == [["pkg.a", "pkg.b", "pkg.c"]]
    assert describe(circles[0]) == "pkg.a (line 1) -> pkg.b (line 4) -> pkg.c (line 4) -> pkg.a"
    _write(tmp_path, {"pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    import pkg.a\n"})
    assert import_circles(paths) == []


def room_of(module: str):
    """The adapter room of ``module`` (``errors`` counts as the first), or None."""
    parts = module.split(".")
    if parts[:2] != ["sparsebalance_megatron", "megatron"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in ROOM_ORDER else None


def in_rooms(paths):
    """(path, room) of each of ``paths`` that lies in an adapter room."""
    for path in paths:
        room = room_of(module_name(path))
        if room is not None:
            yield path, room


def room_problems(paths) -> list[str]:
    known = {module_name(p) for p in paths}
    out = []
    for path, room in in_rooms(paths):
        for mod, line in import_edges(path, known):
            other = room_of(mod)
            if other is not None and ROOM_ORDER.index(other) > ROOM_ORDER.index(room):
                out.append(f"{rel(path)} line {line}: the {room} room imports {mod} "
                           f"(the {other} room comes after it)")
    return out


def test_rooms_import_only_the_rooms_before_them():
    problems = room_problems(MODULES)
    assert not problems, "; ".join(problems)


def test_the_room_check_names_a_backward_import(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    base = "sparsebalance_megatron/megatron/"
    paths = _write(tmp_path, {
        base + "__init__.py": "", base + "errors.py": "", base + "hooks.py": "from .step import a\n",
        base + "model/__init__.py": "", base + "model/spec.py": "from ..errors import E\n",
        base + "step/__init__.py": "", base + "step/a.py": "from ..model import spec\n",
        base + "runtime/__init__.py": "",
        base + "runtime/comm.py": "def f():\n    from ..model.spec import g\n"})
    assert room_problems(paths) == [
        f"{base}runtime/comm.py line 2: the runtime room imports "
        f"sparsebalance_megatron.megatron.model.spec (the model room comes after it)"]


def top_level_names(path: Path) -> set:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def lazy_export_problems(paths) -> list[str]:
    """A room's ``__init__`` exports names lazily from ``_PUBLIC`` ({name: module}); each must be
    a top-level name of that module (else ``from room import name`` fails only when first used)."""
    out = []
    for path, _ in in_rooms(paths):
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_PUBLIC"
                                                    for t in node.targets):
                for name, module in ast.literal_eval(node.value).items():
                    target = path.parent / f"{module}.py"
                    if not target.exists() or name not in top_level_names(target):
                        out.append(f"{rel(path)}: _PUBLIC[{name!r}] = {module!r}, which does not "
                                   f"define it")
    return out


def test_rooms_export_only_names_their_modules_define():
    problems = lazy_export_problems(MODULES)
    assert not problems, "; ".join(problems)


def test_the_export_check_names_a_stale_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    base = "sparsebalance_megatron/megatron/step/"
    paths = _write(tmp_path, {
        base + "__init__.py": '_PUBLIC = {"run": "callback", "gone": "callback", "x": "nope"}\n',
        base + "callback.py": "def run():\n    pass\n"})
    assert lazy_export_problems(paths) == [
        f"{base}__init__.py: _PUBLIC['gone'] = 'callback', which does not define it",
        f"{base}__init__.py: _PUBLIC['x'] = 'nope', which does not define it"]
