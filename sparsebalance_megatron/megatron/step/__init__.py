"""The adapter's ``step`` room: one training step: the callback and its planning, checks, do-no-harm
choice, timers, metrics, data iterator and resume state.

Modules: ``agreement`` (a step's rounds with the other DP ranks: their one driver and the DP
group's reductions), ``ahead`` (the planner process and thread) and ``planner_worker`` (the
process's own side), ``callback``, ``checks``, ``choice``, ``data``, ``drafting``, ``exchange`` (the per-step gather and
reductions) and ``record`` (its fixed-size records),
``microbatches`` (a step's own micro-batch count through Megatron's calculator), ``planning``,
``quality_probe`` (the quality model refreshed from forward passes of the network in training),
``reporting`` (and ``report_sums``, its figures as sums over the DP group), ``state``,
``timing``. May import: ``errors``, ``runtime``, ``model``, ``launch`` (and megatron and the
pure layers); never a room after it (docs/DESIGN.md section 2). Its exports: ``_PUBLIC``
(``lazy_exports``).
"""

from .. import lazy_exports

_PUBLIC = {
    "SparseBalanceCallback": "callback",
    "EvalIterator": "data",
    "check_vocab": "data",
    "load_data": "data",
    "megatron_text_tokenizer": "data",
    "Planner": "ahead",
    "PlannerProcess": "ahead",
    "Drafter": "drafting",
    "unit_work": "report_sums",
    "MicrobatchTimers": "timing",
    "TeeTimers": "timing",
}
__all__, __getattr__ = lazy_exports(__name__, _PUBLIC)
