"""The adapter's ``step`` room: one training step: the callback and its planning, checks, do-no-harm
choice, timers, metrics, data iterator and resume state.

Modules: ``ahead`` (the planner process and thread) and ``planner_worker`` (the process's own
side), ``callback``, ``checks``, ``choice``, ``data``, ``drafting``, ``exchange`` (the per-step
gather and plan broadcast), ``indexed_data``, ``plan_record`` and ``record`` (their fixed-size
records), ``planning``, ``reporting``, ``state``, ``timing``. May import: ``errors``, ``runtime``, ``model``, ``launch``
(and megatron and the pure layers); never a room after it (docs/DESIGN.md section 2). Its public
pieces, the names code outside the room imports, are exported lazily: importing the room imports
none of its modules, so a light entry point stays light.

- ``callback``: ``SparseBalanceCallback``
- ``data``: ``EvalIterator``, ``check_vocab``, ``load_data``, ``megatron_text_tokenizer``
- ``indexed_data``: ``read_indexed_documents``
- ``ahead``: ``Planner`` (the planner thread), ``PlannerProcess``
- ``drafting``: ``Drafter``
- ``reporting``: ``unit_work``
- ``timing``: ``MicrobatchTimers``, ``TeeTimers``
"""

from .. import lazy_exports

_PUBLIC = {
    "SparseBalanceCallback": "callback",
    "EvalIterator": "data",
    "check_vocab": "data",
    "load_data": "data",
    "megatron_text_tokenizer": "data",
    "read_indexed_documents": "indexed_data",
    "Planner": "ahead",
    "PlannerProcess": "ahead",
    "Drafter": "drafting",
    "unit_work": "reporting",
    "MicrobatchTimers": "timing",
    "TeeTimers": "timing",
}
__all__ = sorted(_PUBLIC)
__getattr__ = lazy_exports(__name__, _PUBLIC)
