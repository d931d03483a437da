"""The adapter's ``launch`` room: what runs before the first step: the flag and file checks
(``checks``, ``preflight``), Megatron compatibility shims, the latency model's set-up and the
start-up profile, the profiler, the recorded plans of ``--sb-replay-plans``.

Modules: ``checks``, ``compat``, ``crossover``, ``latency_setup``, ``preflight``, ``profile``
(and the grid it times, ``profile_grid``), ``replay``, ``startup_profile``. May import:
``errors``, ``runtime``, ``model`` (and megatron and the pure layers); never a room after it
(docs/DESIGN.md section 2). Its exports: ``_PUBLIC`` (``lazy_exports``).
"""

from .. import lazy_exports

_PUBLIC = {
    "LaunchError": "checks",
    "check_launch": "checks",
    "cpu_parser_defaults": "checks",
    "activate_cpu_shims": "compat",
    "device": "compat",
    "check_given_table": "latency_setup",
    "load_latency_model": "latency_setup",
    "table_backend": "latency_setup",
    "OneLineParser": "preflight",
    "check_after_parse": "preflight",
    "checked_config": "preflight",
    "uses_plugin_data": "preflight",
    "build_stage": "profile",
    "default_mixes": "profile_grid",
    "device_name": "profile",
    "fit_report": "profile",
    "init_single_process": "profile",
    "profile_identity": "profile",
    "profile_table": "profile",
    "time_microbatch": "profile",
    "plan_replay": "replay",
}
__all__, __getattr__ = lazy_exports(__name__, _PUBLIC)
