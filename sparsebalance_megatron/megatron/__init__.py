"""The only adapter layer between SparseBalance and Megatron: everything here may import megatron.

Rooms, in import order (a room imports only the rooms before it; docs/DESIGN.md section 2):
``errors`` (the one launch error, a leaf every room may import), ``runtime/`` (the process group,
the only torch.distributed user, and the watchdog), ``model/`` (specs, attention modules, the
budget context, loss, conversion), ``launch/`` (checks before the first step, compatibility shims,
the latency model's set-up and profiler), ``step/`` (the per-step callback, its planning, checks,
data, state and report). Entries: ``hooks`` (the one entry from Megatron's side: its
``pretrain_gpt.py`` / ``pretrain_hybrid.py`` call it) and ``profile_cli`` (``python -m
sparsebalance_megatron.megatron.profile_cli``, ``sparsebalance-profile``).

Nothing is imported eagerly, so ``import sparsebalance_megatron`` never needs megatron.
"""

from importlib import import_module


def lazy_exports(package: str, public: dict):
    """A room's module ``__getattr__``: ``public`` ({name: module of the room}) imported on first
    use, so that importing the room imports none of its modules (a light entry point stays
    light). Every room's ``__init__`` sets ``__getattr__ = lazy_exports(__name__, _PUBLIC)``."""
    def __getattr__(name: str):
        if name in public:
            return getattr(import_module(f"{package}.{public[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
