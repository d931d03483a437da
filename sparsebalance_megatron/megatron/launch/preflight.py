"""The plugin's own settings, checked before Megatron builds a tokenizer or a process group.

Megatron's flow is ``parse_and_validate_args`` (parse the flags, ``validate_args``, then
``set_global_variables``, which builds the tokenizer) and ``pretrain()`` (process groups, then the
model). A mistake in a plugin setting must end the launch with one line naming the flag and its
value before any of that, not as whatever Megatron trips over next (a tokenizer it cannot build
for lack of the data's vocabulary, or a latency table first read after the model is built).
Two points come before Megatron's own work:

- ``hooks.args_defaults`` is evaluated before ``parse_and_validate_args`` is called: it reads the
  ``--sb-*`` flags with ``OneLineParser`` and checks them with ``check_config`` (types, choices,
  domains, and the files and directories the flags name);
- the parser that ``hooks.extra_args_provider`` returns checks what it parsed, before Megatron
  validates it (``check_parsed``): the same, plus what needs Megatron's flags (the latency table
  against the model flags, attention dropout, ``--save`` without ``--save-interval``, a watchdog
  threshold the distributed timeout would beat), plus the launch conflicts the flags alone show
  (``launch.checks.flag_conflicts``, handed in by the hooks as ``conflicts``).

``hooks.install`` then runs the launch checks (``launch.check_launch``) and compares the latency
table with the validated model (padded vocabulary, derived sizes), still before any process
group. Every refusal is one ``LaunchError`` line (the hooks print it as ``error: ...``).
No torch.distributed; megatron only inside functions.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, Optional

from ...arguments import config_and_problems
from ...config import ConfigError, SparseBalanceConfig, flag_name, path_fields
from ..errors import LaunchError
from ..runtime.refusal import refusal
from ..runtime.watchdog import watchdog_problems


class OneLineParser(argparse.ArgumentParser):
    """argparse prints its usage and the message, then exits 2: here the message alone, which
    names the flag and the value (``argument --sb-anchor: invalid choice: 'top'``)."""

    def error(self, message):
        raise LaunchError(message)


def uses_plugin_data(sb: SparseBalanceConfig, packed_data: Optional[bool]) -> bool:
    """The plugin's packed data path: always for our entry, else when DST or SAB needs it."""
    if packed_data is not None:
        return bool(packed_data)
    return sb.dst_enabled or sb.batching_enabled or sb.packing != "auto"


def config_problems(sb: SparseBalanceConfig) -> list[str]:
    """What is wrong with the files and directories the plugin's flags name, one entry each,
    every entry naming its flag: each flag declared a path (``config.path_fields``) is checked
    by its kind, an input file also by its reader (``INPUT_READERS``) where the run reads it."""
    out = []
    for name in path_fields("input"):
        path = getattr(sb, name)
        used, reader = INPUT_READERS.get(name, (None, None))
        if path and (used is None or used(sb)):    # one this run never reads is not checked
            bad = _input_file_problems(flag_name(name), path)
            out += [b + INPUT_HINTS.get(name, "") for b in bad] or \
                (reader(sb) if reader is not None else [])
    if _reads_quality_cost(sb) and not sb.quality_cost:
        out += _quality_cost_problems(sb)                # the shipped one
    for name in path_fields("output"):
        if getattr(sb, name):
            out += _output_file_problems(flag_name(name), getattr(sb, name))
    for name in path_fields("directory"):
        if getattr(sb, name):
            out += _directory_problems(flag_name(name), getattr(sb, name))
    out += _profile_cache_problems(sb)
    return out


def _input_file_problems(flag: str, path: str) -> list[str]:
    """A file the run reads: it must exist, be a regular file and be readable."""
    if not os.path.exists(path):
        return [f"{flag} {path}: file not found"]
    if os.path.isdir(path):
        return [f"{flag} {path}: is a directory (expected a file)"]
    if not os.path.isfile(path):
        return [f"{flag} {path}: not a regular file"]
    if not os.access(path, os.R_OK):
        return [f"{flag} {path}: not readable"]
    return []


def _latency_table_problems(sb: SparseBalanceConfig) -> list[str]:
    from ...latency.table import LatencyTableError, read_table

    try:
        read_table(sb.latency_table)
    except LatencyTableError as e:
        return [f"{flag_name('latency_table')}: {e}"]
    return []


def _reads_quality_cost(sb: SparseBalanceConfig) -> bool:
    return sb.dst_enabled and sb.dst_objective == "quality"


def _quality_cost_problems(sb: SparseBalanceConfig) -> list[str]:
    from ...quality.cost import QualityCostError, load_quality_cost

    try:
        load_quality_cost(sb.quality_cost)
    except QualityCostError as e:
        what = f"{flag_name('quality_cost')} {sb.quality_cost}" if sb.quality_cost else \
            f"{flag_name('dst_objective')} quality (the shipped quality cost)"
        return [f"{what}: {e}{INPUT_HINTS['quality_cost']}"]
    return []


def _replay_plans_problems(sb: SparseBalanceConfig) -> list[str]:
    from .replay import RecordedPlans, ReplayError

    try:
        RecordedPlans.read(sb.replay_plans)
    except ReplayError as e:
        return [str(e)]
    return []


def _uses_latency_table(sb: SparseBalanceConfig) -> bool:
    from .latency_setup import uses_latency_table
    return uses_latency_table(sb)


# Each input file flag: (whether this run reads the file, its reader: content problems named by
# the flag). A flag missing here gets the file checks only (tests/unit/test_file_flags.py
# fails for it: unreadable content must be refused too).
INPUT_READERS = {"latency_table": (_uses_latency_table, _latency_table_problems),
                 "quality_cost": (_reads_quality_cost, _quality_cost_problems),
                 "replay_plans": (None, _replay_plans_problems)}
INPUT_HINTS = {"quality_cost": f" (quality is the default objective; "
                               f"{flag_name('dst_objective')} density plans without a quality "
                               f"cost)"}


def _profile_cache_problems(sb: SparseBalanceConfig) -> list[str]:
    """Without --sb-latency-table a run with DST or SAB profiles one at start-up and caches it
    under --sb-data-cache-dir (checked above when given) or its default: that must be writable
    before the run reaches the profiler."""
    from .latency_setup import uses_latency_table

    if sb.data_cache_dir or sb.latency_table or not uses_latency_table(sb):
        return []
    from ...data.sources import default_cache_dir
    return [p.replace(flag_name("data_cache_dir"),
                      f"{flag_name('data_cache_dir')} (default, the start-up latency profile's "
                      f"cache)", 1)
            for p in _directory_problems(flag_name("data_cache_dir"), default_cache_dir())]


def _output_file_problems(flag: str, path: str) -> list[str]:
    """A file the run appends to: its directory must exist and be writable."""
    where = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return [f"{flag} {path}: is a directory (expected a file to append to)"]
    if not os.path.isdir(where):
        return [f"{flag} {path}: directory {where} does not exist"]
    if not os.access(where, os.W_OK):
        return [f"{flag} {path}: directory {where} is not writable"]
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return [f"{flag} {path}: exists and is not writable"]
    return []


def _directory_problems(flag: str, path: str) -> list[str]:
    """A directory the run may create and write into."""
    if os.path.exists(path) and not os.path.isdir(path):
        return [f"{flag} {path}: exists and is not a directory"]
    if os.path.isdir(path) and not os.access(path, os.W_OK):
        return [f"{flag} {path}: directory is not writable"]
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return [f"{flag} {path}: cannot be created ({parent} is not a directory)"]
    if parent != os.path.abspath(path) and not os.access(parent, os.W_OK):
        return [f"{flag} {path}: cannot be created ({parent} is not writable)"]
    return []


def check_config(sb: SparseBalanceConfig) -> SparseBalanceConfig:
    """``sb`` (validated when built) with the files its flags name; ``LaunchError`` otherwise."""
    bad = config_problems(sb)
    if bad:
        raise LaunchError("; ".join(bad))
    return sb


def _values_and_files(args) -> tuple[SparseBalanceConfig, list[str], bool]:
    """(config, every bad value and every bad file the flags name, whether the values are
    valid): one refusal names them all, not the first alone."""
    sb, bad = config_and_problems(args)
    if not bad:
        return sb, config_problems(sb), True
    try:
        bad += config_problems(sb)   # the files, beside the values (which are named already)
    except (TypeError, ValueError, AttributeError):
        pass                         # a check that needs the bad value: the values suffice
    return sb, bad, False


def checked_config(args) -> SparseBalanceConfig:
    """The config of the parsed ``--sb-*`` flags (``hooks.args_defaults``); one ``LaunchError``
    naming every bad value and file otherwise."""
    sb, bad, _ = _values_and_files(args)
    if bad:
        raise LaunchError("; ".join(bad))
    return sb


def check_parsed(args, *, packed_data: Optional[bool],
                 attention_dropout_default: Optional[float] = None,
                 conflicts: Optional[Callable] = None) -> None:
    """Megatron's namespace as parsed (before ``validate_args``): the plugin's config and files,
    then what needs Megatron's flags, then ``conflicts(args, sb, plugin_data=...)`` (the launch
    conflicts the flags show; their refusal reads ``cannot launch: ...``, as at install). Sets
    ``args.attention_dropout`` when no flag gave it (``hooks.extra_args_provider`` makes its
    default None): 0 with the plugin's attention, whose kernels have no dropout, else
    ``attention_dropout_default`` (Megatron's)."""
    sb, bad, values_ok = _values_and_files(args)
    plugin_data = uses_plugin_data(sb, packed_data)
    bad += watchdog_problems(args, sb)
    if hasattr(args, "attention_dropout"):
        bad += attention_dropout_conflicts(args, sb, plugin_data)
        if args.attention_dropout is None:
            args.attention_dropout = 0.0 if _plugin_attention(args, sb, plugin_data) \
                else attention_dropout_default
    if sb.sparse_attention_enabled or plugin_data:
        save_interval = getattr(args, "save_interval", None)
        if getattr(args, "save", None) and (save_interval is None or save_interval <= 0):
            bad.append(f"--save {args.save} without --save-interval (Megatron saves every N "
                       f"iterations: add --save-interval N)" if save_interval is None else
                       f"--save-interval {save_interval}: expected an integer >= 1")
        table = flag_name("latency_table")
        if values_ok and not any(b.startswith(table) for b in bad):
            bad += _table_problems(args, sb)
    if values_ok:
        from .replay import launch_problems
        bad += launch_problems(args, sb)
    launch = conflicts(args, sb, plugin_data=plugin_data) if values_ok and conflicts else []
    if launch:
        raise LaunchError("cannot launch: " + "; ".join(bad + launch))
    if bad:
        raise LaunchError("; ".join(bad))


def check_after_parse(parser, packed_data: Optional[bool],
                      conflicts: Optional[Callable] = None) -> None:
    """Wrap this parser's ``parse_known_args`` (``parse_args`` calls it) with ``check_parsed``
    (``conflicts`` as there), ending the process with one ``error:`` line: argparse has no hook
    after parsing, and Megatron validates the namespace, prints it and builds its tokenizer
    right after. Also makes ``--attention-dropout``'s default None, so that an explicit value is
    seen. Idempotent."""
    if getattr(parser.parse_known_args, "_sparsebalance", False):
        return
    dropout_default = parser.get_default("attention_dropout")
    if any(a.dest == "attention_dropout" for a in parser._actions):
        parser.set_defaults(attention_dropout=None)   # None: not given (check_parsed decides)
    parse_known = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, rest = parse_known(args, namespace)
        try:
            check_parsed(ns, packed_data=packed_data, attention_dropout_default=dropout_default,
                         conflicts=conflicts)
        except (ConfigError, LaunchError) as e:
            raise refusal(f"error: {e}") from None
        return ns, rest

    parse_known_args._sparsebalance = True
    parser.parse_known_args = parse_known_args


def plugin_core_attention(args, sb: SparseBalanceConfig, plugin_data: bool) -> Optional[str]:
    """What replaces Megatron's core attention (``hooks.install``), or None: the sparse
    attention, or on the plugin's data path with the local implementation (whose
    DotProductAttention refuses packed input) the dense per-document attention."""
    if sb.sparse_attention_enabled:
        return "sparse attention"
    if plugin_data and getattr(args, "transformer_impl", "local") == "local":
        return "the plugin's dense per-document attention"
    return None


def attention_dropout_conflicts(args, sb: SparseBalanceConfig, plugin_data: bool) -> list[str]:
    """The plugin's attention kernels apply no dropout: a non-zero --attention-dropout would be
    silently ignored."""
    p = getattr(args, "attention_dropout", None)
    which = plugin_core_attention(args, sb, plugin_data)
    if not p or which is None:
        return []
    return [f"--attention-dropout {p} with {which}: its kernels apply no attention dropout; "
            f"pass --attention-dropout 0 (the default with the plugin's attention)"]


def dense_kernel_conflicts(args, sb: SparseBalanceConfig, plugin_data: bool) -> list[str]:
    """``--sb-dense-kernel`` picks the plugin's dense kernel (sparse attention's routed
    documents, the dense per-document attention): where neither runs it would be ignored."""
    if sb.dense_kernel == "auto" or plugin_core_attention(args, sb, plugin_data) is not None:
        return []
    impl = getattr(args, "transformer_impl", "local")
    return [f"{flag_name('dense_kernel')} {sb.dense_kernel} " + (
        f"with --transformer-impl {impl}: Transformer Engine's attention runs the dense layers"
        if plugin_data else "without sparse attention or --sb-batching: Megatron's own "
        "attention runs the dense layers") + " (the flag serves sparse attention's routed "
        "documents and dense + SAB on --transformer-impl local)"]


def _plugin_attention(args, sb: SparseBalanceConfig, plugin_data: bool) -> bool:
    return plugin_core_attention(args, sb, plugin_data) is not None


def _table_problems(args, sb: SparseBalanceConfig) -> list[str]:
    """The given latency table against this launch's device, versions, attention blocks and the
    model flags as given (``latency_setup.flag_expectation``); forced tables are not compared."""
    from .latency_setup import flag_expectation, uses_latency_table

    if not (sb.latency_table and uses_latency_table(sb)) or sb.latency_table_force:
        return []
    if getattr(args, "num_layers", None) is None or getattr(args, "hidden_size", None) is None \
            or getattr(args, "num_attention_heads", None) is None:
        return []    # Megatron's validation names the missing model flag
    from ...latency.table import LatencyTableError, check_compatible, read_table
    try:
        check_compatible(read_table(sb.latency_table), flag_expectation(args, sb),
                         sb.latency_table, force=False)
    except LatencyTableError as e:
        return [f"{flag_name('latency_table')}: {e}"]
    return []
