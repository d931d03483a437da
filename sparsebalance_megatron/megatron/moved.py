"""The adapter's old module paths, kept importable as aliases that name where each module went.

The adapter was one flat folder until its modules moved into rooms (``model/``, ``runtime/``,
``launch/``, ``step/``); code that imported ``sparsebalance_megatron.megatron.core_attention``
and the like would break. ``MOVED`` maps each old module name to its new one; ``install()``
puts a finder at the end of ``sys.meta_path`` that answers only for those names (and only after
the regular finders have found no such file), so that the old path imports a thin module whose
attributes are the new module's, with one ``FutureWarning`` naming the new path (once per process:
the alias then sits in ``sys.modules``). New code imports the public names from
``sparsebalance_megatron.megatron`` (its ``__init__``), or from the rooms.
Imports nothing of megatron; no torch.distributed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

PACKAGE = "sparsebalance_megatron.megatron"

# old module (directly under the package) -> its module now (relative to the package)
MOVED = {
    "attention_check": "model.attention_check", "budget": "model.budget",
    "context_parallel": "model.context_parallel", "core_attention": "model.core_attention",
    "dense_attention": "model.dense_attention", "hf_convert": "model.hf_convert",
    "hybrid": "model.hybrid", "loss": "model.loss", "spec": "model.spec",
    "comm": "runtime.comm", "watchdog": "runtime.watchdog",
    "watchdog_judgement": "runtime.watchdog_judgement",
    "watchdog_megatron": "runtime.watchdog_megatron",
    "compat": "launch.compat", "cpu_compat": "launch.compat", "crossover": "launch.crossover",
    "latency_setup": "launch.latency_setup", "preflight": "launch.preflight",
    "profile": "launch.profile", "replay": "launch.replay",
    "startup_profile": "launch.startup_profile",
    "callback": "step.callback", "data": "step.data", "reporting": "step.reporting", "state": "step.state", "timing": "step.timing",
    "step_checks": "step.checks", "step_choice": "step.choice", "step_planning": "step.planning",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec):
        return None   # a fresh module: the real one keeps its own name and spec

    def exec_module(self, module: types.ModuleType) -> None:
        warnings.warn(f"{self.old} moved to {self.new}: import it from there (or its public "
                      f"names from {PACKAGE}); the old path is an alias that will go",
                      FutureWarning, stacklevel=2)
        real = importlib.import_module(self.new)
        module.__doc__ = f"Alias of {self.new} (moved)."
        module.__getattr__ = lambda name: getattr(real, name)
        module.__dir__ = lambda: dir(real)
        module.__all__ = getattr(real, "__all__",
                                 [n for n in vars(real) if not n.startswith("_")])


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds ``PACKAGE.<old>`` for each old name of ``MOVED``; nothing else."""

    def find_spec(self, fullname, path=None, target=None):
        parent, _, name = fullname.rpartition(".")
        if parent != PACKAGE or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(
            fullname, _AliasLoader(fullname, f"{PACKAGE}.{MOVED[name]}"))


def install() -> None:
    """Append the finder to ``sys.meta_path`` once (idempotent)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
