"""The adapter's ``runtime`` room: the process group (``comm``: the only module that touches
torch.distributed), the watchdog that reports a stalled or dead rank (its rules in
``watchdog_judgement``, its wiring into Megatron in ``watchdog_megatron``), and ``children``:
processes a rank starts die with it.

Modules: ``children``, ``comm``, ``watchdog``, ``watchdog_judgement``, ``watchdog_megatron``.
May import: ``errors`` (and megatron and the pure layers); never a room after it (docs/DESIGN.md
section 2). Its exports: ``_PUBLIC`` (``lazy_exports``).
"""

from .. import lazy_exports

_PUBLIC = {
    "die_with_parent": "children",
    "say": "comm",
    "watchdog_problems": "watchdog",
    "start_for_megatron": "watchdog_megatron",
    "watch_megatron_phases": "watchdog_megatron",
}
__all__, __getattr__ = lazy_exports(__name__, _PUBLIC)
