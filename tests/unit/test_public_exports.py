"""``sparsebalance_megatron.megatron`` exports what a user wires by hand, from one place, and the
adapter's module paths from before its rooms still import (with a warning naming the new path).

Checked: every exported name is the object its room module defines (and the room's own export
agrees); importing the package imports no megatron; each old path's alias is the new module's
objects, warns once with a ``FutureWarning`` naming the new path, and no alias hides a real file;
docs/TRAINING.md's "Wiring it by hand" imports only these exports and its spec example runs.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = "sparsebalance_megatron.megatron"


def test_every_export_is_its_room_modules_object():
    import sparsebalance_megatron.megatron as m

    assert set(m.__all__) == set(m.PUBLIC) | {"hooks"}
    for name, module in m.PUBLIC.items():
        obj = getattr(m, name)
        assert obj is getattr(importlib.import_module(f"{PKG}.{module}"), name), name
        room = module.split(".")[0]
        if room != "errors":     # the room re-exports it too (when it does), the same object
            exports = getattr(importlib.import_module(f"{PKG}.{room}"), "_PUBLIC", {})
            if name in exports:
                assert getattr(importlib.import_module(f"{PKG}.{room}"), name) is obj, name
    assert m.hooks is importlib.import_module(f"{PKG}.hooks")
    from sparsebalance_megatron.megatron import SparseCoreAttention, hooks  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        m.nothing_here


def test_the_hand_wiring_exports_are_there():
    import sparsebalance_megatron.megatron as m

    for name in ("SparseCoreAttention", "get_sparsebalance_layer_spec",
                 "sparse_core_attention_spec", "layer_spec_builder", "swap_core_attention",
                 "BudgetContext", "SparsePackedSeqParams", "check_sparse_attention"):
        assert name in m.__all__, name
    for hook in ("extra_args_provider", "args_defaults", "install", "model_config",
                 "datasets_provider", "forward_step", "finish"):
        assert callable(getattr(m.hooks, hook)), hook


def test_importing_the_package_imports_no_megatron():
    code = ("import sys, sparsebalance_megatron.megatron as m; "
            "print(sorted(k for k in sys.modules if k == 'megatron' or k.startswith('megatron.')"
            " or k.startswith('sparsebalance_megatron.megatron.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "['sparsebalance_megatron.megatron.moved']", out


def test_no_alias_hides_a_real_module_and_every_target_exists():
    from sparsebalance_megatron.megatron.moved import MOVED

    root = REPO / "sparsebalance_megatron" / "megatron"
    for old, new in MOVED.items():
        assert not (root / f"{old}.py").exists() and not (root / old).is_dir(), \
            f"{old}: a real module there would make its alias unreachable"
        assert (root / (new.replace(".", "/") + ".py")).exists(), new


@pytest.mark.parametrize("old, new", [("core_attention", "model.core_attention"),
                                      ("spec", "model.spec"), ("callback", "step.callback"),
                                      ("comm", "runtime.comm"), ("cpu_compat", "launch.compat")])
def test_an_old_path_imports_the_new_module_with_one_warning(old, new):
    sys.modules.pop(f"{PKG}.{old}", None)
    with pytest.warns(FutureWarning) as caught:
        alias = importlib.import_module(f"{PKG}.{old}")
    msgs = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(msgs) == 1 and f"{PKG}.{old} moved to {PKG}.{new}" in msgs[0], msgs
    real = importlib.import_module(f"{PKG}.{new}")
    public = [n for n in vars(real) if not n.startswith("_")]
    assert public and all(getattr(alias, n) is getattr(real, n) for n in public)
    assert set(public) <= set(dir(alias))
    with pytest.raises(AttributeError):
        alias.no_such_name
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        importlib.import_module(f"{PKG}.{old}")                       # cached: no second warning
        exec(f"from {PKG}.{old} import {public[0]}", {})
    assert not [w for w in again if issubclass(w.category, FutureWarning)]


def test_an_unknown_old_name_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{PKG}.never_was_here")


def _hand_wiring_blocks() -> list[str]:
    text = (REPO / "docs/TRAINING.md").read_text()
    section = text.split("## Wiring it by hand", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_training_md_hand_wiring_uses_only_the_exports():
    import sparsebalance_megatron
    import sparsebalance_megatron.megatron as m

    blocks = _hand_wiring_blocks()
    assert len(blocks) == 2
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("sparsebalance"):
                assert node.module in ("sparsebalance_megatron", PKG), node.module
                public = m.__all__ if node.module == PKG else sparsebalance_megatron.__all__
                assert all(a.name in public for a in node.names), [a.name for a in node.names]
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id == "hooks":
                assert callable(getattr(m.hooks, node.attr)), node.attr


def test_training_md_spec_example_builds_the_spec():
    """The custom-builder example as written (the local implementation standing in for
    transformer-engine, and Megatron's local spec for the user's own)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from sparsebalance_megatron.megatron import SparseCoreAttention

    code = _hand_wiring_blocks()[1].replace('"transformer_engine"', '"local"')
    scope = {"my_layer_spec": get_gpt_layer_local_spec()}
    exec(code, scope)
    for spec in (scope["layer_spec"],):
        core = spec.submodules.self_attention.submodules.core_attention
        assert core.module is SparseCoreAttention and core.params["budget"] is scope["budget"]
