"""One adapter layer: the import rules of docs/DESIGN.md section 2, checked on every module of the
package with ``ast``.

1. Only ``sparsebalance_megatron/megatron/`` imports ``megatron``, and no other module imports our
   ``.megatron`` subpackage at module level. The one allowed exception is a lazy import inside a
   function of ``sparsebalance_megatron/data/corpus.py`` of ``..megatron.indexed_data`` (reading a
   user's Megatron indexed data set needs Megatron's reader; the pure corpus code does not).
2. Only ``sparsebalance_megatron/megatron/comm.py`` imports ``torch.distributed`` (other adapter
   modules may use Megatron's own distributed helpers), and only it touches ``torch.distributed.*``.
3. ``import sparsebalance_megatron`` and every pure subpackage (every one but ``megatron``) with all
   of its modules import in a fresh interpreter without ``megatron`` entering ``sys.modules``.

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
COMM = ADAPTER / "comm.py"
# (file, the one module it may import lazily inside a function)
LAZY_ADAPTER_IMPORTS = {"sparsebalance_megatron/data/corpus.py":
                        "sparsebalance_megatron.megatron.indexed_data"}
KNOWN_VIOLATIONS: dict = {}


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
    corpus_lazy = [(m, f) for m, _, f in imports(PKG / "data" / "corpus.py")
                   if _is(m, "sparsebalance_megatron.megatron")]
    assert all(f for _, f in corpus_lazy), "the corpus exception must stay lazy"


@pytest.mark.parametrize("path", [_param("megatron", p) for p in MODULES
                                  if ADAPTER not in p.parents])
def test_only_the_adapter_imports_megatron(path):
    allowed_lazy = LAZY_ADAPTER_IMPORTS.get(rel(path))
    bad = []
    for mod, line, in_func in imports(path):
        if _is(mod, "megatron"):
            bad.append(f"line {line}: imports {mod}")
        elif _is(mod, "sparsebalance_megatron.megatron"):
            if not in_func:
                bad.append(f"line {line}: imports {mod} at module level")
            elif allowed_lazy is None or not _is(mod, allowed_lazy):
                bad.append(f"line {line}: imports {mod} inside a function")
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

_CHECK = r"""
import importlib, json, pkgutil, sys
name = sys.argv[1]
mod = importlib.import_module(name)
names = [name]
if hasattr(mod, "__path__") and name != "sparsebalance_megatron":  # the root: itself only
    for info in pkgutil.walk_packages(mod.__path__, name + "."):
        if info.name.rsplit(".", 1)[-1] != "__main__":
            importlib.import_module(info.name)
            names.append(info.name)
print(json.dumps({"imported": names,
                  "megatron": sorted(m for m in sys.modules if m == "megatron" or m.startswith(("megatron.", "sparsebalance_megatron.megatron")))}))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> dict:
    """Each pure (sub)package imported with all its modules in its own interpreter, concurrently."""
    procs = {name: subprocess.Popen([sys.executable, "-c", _CHECK, name], cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in PURE}
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[name] = (p.returncode, stdout, stderr)
    return out


def test_pure_list_covers_the_named_subpackages():
    for name in ("attention", "latency", "sim", "policy", "batching", "data", "plan", "config",
                 "arguments"):
        assert f"sparsebalance_megatron.{name}" in PURE


@pytest.mark.parametrize("name", PURE)
def test_pure_packages_import_without_megatron(name, fresh_imports):
    rc, stdout, stderr = fresh_imports[name]
    assert rc == 0, f"import {name} failed:\n{stderr[-3000:]}"
    result = json.loads(stdout.strip().splitlines()[-1])
    assert name in result["imported"]
    assert result["megatron"] == [], f"importing {name} pulled in {result['megatron'][:5]}"
