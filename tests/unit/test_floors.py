"""The package's floors, counting the modules ``importlib`` loads: a module named to
``import_module`` (or ``__import__``) by a string, or by an f-string whose fixed part names a
package (``f"{__name__}.{room}"``: every module under it but a ``__main__``), is an import like
any other. Lazy imports count too (``test_import_boundaries``' edges).

1. ``kernels/`` is the ground floor: it imports nothing of the package but itself (its
   warm-ups compile on ``kernels.records``' samples, not on the simulator's or the policy's
   objects).
2. No circle between the package's modules (a package's ``__init__`` loading its own children
   is how packages work, as in ``test_import_boundaries``), and none between its rooms (a
   subpackage or a top-level module): every room stands above all it imports, so no import
   runs back up a floor, lazy imports included.
3. Every ``import_module`` call the walk cannot resolve is one of ``DYNAMIC``, with why it
   stays on its floor: a new one is read, not passed over.
"""

from __future__ import annotations

import ast

from test_import_boundaries import (MODULES, PKG, describe,
                                    import_circles, import_edges, module_name, rel)

DYNAMIC = {
    "sparsebalance_megatron/megatron/__init__.py": "lazy_exports: a room's own modules, by "
    "the names its _PUBLIC lists (test_import_boundaries' rule 6)",
    "sparsebalance_megatron/megatron/moved.py": "an old module path's alias of the module "
    "that replaced it (moved.MOVED)",
    "sparsebalance_megatron/attention/torch_compat.py": "torch's own modules, by name",
    "sparsebalance_megatron/attention/compile_gate_worker.py": "the Triton kernel a compile "
    "spec names (a worker process)",
}
NAMES = {m: p for p, m in ((p, module_name(p)) for p in MODULES)}


def _prefix(arg, name: str, package: str):
    """The fixed start of a module name given as a string or an f-string (``__name__`` and
    ``__package__`` filled in), or None."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if not isinstance(arg, ast.JoinedStr):
        return None
    out = ""
    for part in arg.values:
        if isinstance(part, ast.Constant):
            out += part.value
        elif isinstance(part.value, ast.Name) and part.value.id in ("__name__", "__package__"):
            out += name if part.value.id == "__name__" else package
        else:
            break
    return out or None


def importlib_edges(path) -> tuple[list, list]:
    """((module, line) the ``import_module`` / ``__import__`` calls of ``path`` load, the
    lines of those it cannot resolve)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges, unresolved = [], []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Call) and node.args and (
                getattr(node.func, "attr", None) == "import_module"
                or getattr(node.func, "id", None) in ("import_module", "__import__"))):
            continue
        prefix = _prefix(node.args[0], name, package)
        hits = [] if prefix is None else [m for m in NAMES if m == prefix or (
            prefix.endswith(".") and m.startswith(prefix) and not m.endswith(".__main__"))]
        if prefix is not None and not prefix.startswith("sparsebalance_megatron"):
            continue                             # another distribution's module
        if not hits:
            unresolved.append(node.lineno)
        edges += [(m, node.lineno) for m in hits if m != name]
    return edges, unresolved


def all_edges(path, known) -> list:
    """``import_edges`` and importlib's loads, but a package's ``__init__`` loading its own
    children (how packages work: ``import_edges`` leaves those out too)."""
    name = module_name(path)
    return import_edges(path, known) + [
        (m, line) for m, line in importlib_edges(path)[0]
        if not (path.name == "__init__.py" and m.startswith(name + "."))]


def _room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_importlib_loads_are_seen():
    edges, unresolved = importlib_edges(PKG / "kernels" / "__init__.py")
    assert {m for m, _ in edges} >= {"sparsebalance_megatron.kernels.band",
                                     "sparsebalance_megatron.kernels.graph"}
    assert not unresolved


def test_kernels_import_nothing_of_the_package_but_themselves():
    bad = [f"{rel(p)} line {line}: {m}" for p in MODULES if _room(module_name(p)) == "kernels"
           for m, line in all_edges(p, set(NAMES)) if _room(m) != "kernels"]
    assert not bad, "kernels/ imports from above the ground floor: " + "; ".join(bad)


def test_no_circle_and_no_room_importing_back_up():
    circles = import_circles(MODULES, edges=all_edges)
    assert not circles, "import circles, importlib's loads counted: " + \
        "; ".join(describe(c) for c in circles)
    rooms: dict = {}
    for p in MODULES:
        for m, line in all_edges(p, set(NAMES)):
            a, b = _room(module_name(p)), _room(m)
            if a != b:
                rooms.setdefault(a, {}).setdefault(b, f"{rel(p)} line {line}")
    floor: dict = {}

    def stand(room, path=()):                    # a room's floor: one above all it imports
        assert room not in path, "rooms import each other: " + " -> ".join(
            f"{r} ({rooms[r][n]})" for r, n in zip(path[path.index(room):],
                                                   path[path.index(room) + 1:] + (room,)))
        if room not in floor:
            floor[room] = 1 + max((stand(r, path + (room,)) for r in rooms.get(room, ())),
                                  default=0)
        return floor[room]

    for room in sorted(rooms):
        stand(room)
    assert floor["kernels"] == 1 and floor["sim"] <= floor["policy"] - 1


def test_every_unresolved_dynamic_import_is_known():
    seen = {rel(p): importlib_edges(p)[1] for p in MODULES}
    unknown = {f: lines for f, lines in seen.items() if lines and f not in DYNAMIC}
    assert not unknown, f"import_module calls the walk cannot follow (add to DYNAMIC with why " \
                        f"they stay on their floor, or name the module): {unknown}"
    assert all(seen.get(f) for f in DYNAMIC), "a DYNAMIC entry no longer holds such a call"
