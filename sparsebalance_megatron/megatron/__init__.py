"""The only adapter layer between SparseBalance and Megatron: everything here may import megatron.

Rooms, in import order (a room imports only the rooms before it; docs/DESIGN.md section 2):
``errors`` (the one launch error, a leaf every room may import), ``runtime/`` (the process group,
the only torch.distributed user, and the watchdog), ``model/`` (specs, attention modules, the
budget context, loss, conversion), ``launch/`` (checks before the first step, compatibility shims,
the latency model's set-up and profiler), ``step/`` (the per-step callback, its planning, checks,
data, state and report). Entries: ``hooks`` (the one entry from Megatron's side: its
``pretrain_gpt.py`` / ``pretrain_hybrid.py`` call it) and ``profile_cli`` (``python -m
sparsebalance_megatron.megatron.profile_cli``, ``sparsebalance-profile``).

What a user wires by hand (a training script of their own, a custom model builder) is exported
here, from one place, lazily (``PUBLIC``: importing this package imports none of the modules,
and no megatron). ``docs/TRAINING.md`` ("Wiring it by hand") shows them in use:

- the six calls around Megatron's ``pretrain()``: ``hooks`` (the module: ``extra_args_provider``,
  ``args_defaults``, ``install`` or ``model_config``, ``datasets_provider``, ``forward_step``,
  ``finish``);
- the attention and its spec: ``SparseCoreAttention``, ``DenseVarlenCoreAttention``,
  ``sparse_core_attention_spec``, ``get_sparsebalance_layer_spec``, ``layer_spec_builder``,
  ``swap_core_attention``, ``swap_hybrid_core_attention``, ``install_attention_spec``,
  ``is_hybrid_config``; the budget they read: ``BudgetContext``, ``SparsePackedSeqParams``;
  the check that a built model runs it: ``check_sparse_attention``;
- the step: ``SparseBalanceCallback``, ``MicrobatchTimers``, ``TeeTimers``, ``loss_func``;
- the launch: ``check_launch``, ``LaunchError``.

The configuration is the package's: ``sparsebalance_megatron.SparseBalanceConfig``,
``add_sparsebalance_args``, ``config_from_args``. The modules' paths before the rooms
(``sparsebalance_megatron.megatron.core_attention`` and the rest) still import, with a
``FutureWarning`` naming the new path (``moved``).
Nothing is imported eagerly, so ``import sparsebalance_megatron`` never needs megatron.
"""

from importlib import import_module

from . import moved


def lazy_exports(package: str, public: dict):
    """A room's front page: ``(__all__, __getattr__)`` for ``public`` ({name: the room's module
    that defines it}, the names code outside the room imports). Each name is imported on first
    use, so importing the room imports none of its modules and a light entry point stays light.
    Every room's ``__init__`` ends ``__all__, __getattr__ = lazy_exports(__name__, _PUBLIC)``."""
    def __getattr__(name: str):
        if name in public:
            return getattr(import_module(f"{package}.{public[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return sorted(public), __getattr__


# name -> its module, relative to this package (each a room's module; the rooms export them too)
PUBLIC = {
    "SparseCoreAttention": "model.core_attention",
    "DenseVarlenCoreAttention": "model.dense_attention",
    "BudgetContext": "model.budget",
    "SparsePackedSeqParams": "model.budget",
    "sparse_core_attention_spec": "model.spec",
    "get_sparsebalance_layer_spec": "model.spec",
    "layer_spec_builder": "model.spec",
    "swap_core_attention": "model.spec",
    "swap_hybrid_core_attention": "model.spec",
    "install_attention_spec": "model.hybrid",
    "is_hybrid_config": "model.hybrid",
    "check_sparse_attention": "model.attention_check",
    "loss_func": "model.loss",
    "SparseBalanceCallback": "step.callback",
    "MicrobatchTimers": "step.timing",
    "TeeTimers": "step.timing",
    "check_launch": "launch.checks",
    "LaunchError": "errors",
}
_names, _exports = lazy_exports(__name__, PUBLIC)
__all__ = sorted([*_names, "hooks"])


def __getattr__(name: str):
    if name == "hooks":   # the module (``from sparsebalance_megatron.megatron import hooks``)
        return import_module(f"{__name__}.hooks")
    return _exports(name)


moved.install()
