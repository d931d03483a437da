"""The adapter's ``launch`` room: what runs before the first step: the flag and file checks
(``checks``, ``preflight``), Megatron compatibility shims, the latency model's set-up and the
start-up profile, the profiler, the recorded plans of ``--sb-replay-plans``.

Modules: ``checks``, ``compat``, ``crossover``, ``latency_setup``, ``preflight``, ``profile``,
``replay``, ``startup_profile``. May import: ``errors``, ``runtime``, ``model`` (and megatron and
the pure layers); never a room after it (docs/DESIGN.md section 2). Its public pieces, the names
code outside the room imports, are exported lazily: importing the room imports none of its modules,
so a light entry point stays light.

- ``checks``: ``LaunchError``, ``check_launch``, ``cpu_parser_defaults``
- ``compat``: ``activate_cpu_shims``, ``device``
- ``latency_setup``: ``check_given_table``, ``load_latency_model``, ``table_backend``
- ``preflight``: ``OneLineParser``, ``check_after_parse``, ``checked_config``, ``uses_plugin_data``
- ``profile``: ``build_stage``, ``default_mixes``, ``device_name``, ``fit_report``,
  ``init_single_process``, ``profile_identity``, ``profile_table``, ``time_microbatch``
- ``replay``: ``plan_replay``
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
    "default_mixes": "profile",
    "device_name": "profile",
    "fit_report": "profile",
    "init_single_process": "profile",
    "profile_identity": "profile",
    "profile_table": "profile",
    "time_microbatch": "profile",
    "plan_replay": "replay",
}
__all__ = sorted(_PUBLIC)
__getattr__ = lazy_exports(__name__, _PUBLIC)
