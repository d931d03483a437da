"""CLI flags generated from ``SparseBalanceConfig`` fields.

``add_sparsebalance_args(parser)`` has the signature Megatron expects of an
``extra_args_provider``; ``config_from_args(args)`` turns the parsed namespace back into a
validated config. Flags and fields are the same set by construction (a test checks it).
This module must not import megatron or torch.
"""

from __future__ import annotations

import argparse
import dataclasses

from .config import ConfigError, SparseBalanceConfig, dest_name, flag_name

_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "Optional[str]": str}

# Flags an earlier version had, and what replaces them: a launch that still passes one stops at
# argument parsing with this line (argparse's "unrecognized arguments" would not say what to use).
REMOVED_FLAGS = {
    "--sb-plan-ahead": "--sb-planner: planning ahead is now the default (--sb-planner process, "
                       "a planner process of its own); --sb-planner thread is what "
                       "--sb-plan-ahead did, --sb-planner inline plans on the training thread",
}


class _Removed(argparse.Action):
    """A removed flag: refused at parsing with what replaces it (``REMOVED_FLAGS``)."""

    def __init__(self, option_strings, dest, **kw):
        kw.pop("nargs", None)
        super().__init__(option_strings, dest, nargs=0, help=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was replaced by {REMOVED_FLAGS[option_string]}")


def field_type(f: dataclasses.Field):
    try:
        return _TYPES[f.type if isinstance(f.type, str) else f.type.__name__]
    except (KeyError, AttributeError):
        raise TypeError(f"SparseBalanceConfig.{f.name}: unsupported field type {f.type!r}")


def add_sparsebalance_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per ``SparseBalanceConfig`` field; usable as Megatron's extra_args_provider."""
    group = parser.add_argument_group("sparsebalance", "SparseBalance (arXiv 2604.13847)")
    for f in dataclasses.fields(SparseBalanceConfig):
        typ = field_type(f)
        # argparse %-formats help strings: a field's plain "10%" must not break --help
        kw = dict(dest=dest_name(f.name), default=f.default,
                  help=f.metadata["help"].replace("%", "%%"))
        if typ is bool:
            group.add_argument(flag_name(f.name), action="store_true", **kw)
        else:
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            group.add_argument(flag_name(f.name), type=typ, **kw)
    for flag in REMOVED_FLAGS:
        group.add_argument(flag, action=_Removed, dest=f"_removed_{flag.strip('-')}",
                           default=argparse.SUPPRESS)
    return parser


def config_from_args(args: argparse.Namespace) -> SparseBalanceConfig:
    """Build and validate the config from a namespace parsed with ``add_sparsebalance_args``."""
    values = {f.name: getattr(args, dest_name(f.name)) for f in dataclasses.fields(SparseBalanceConfig)}
    return SparseBalanceConfig(**values)


def config_and_problems(args: argparse.Namespace) -> tuple[SparseBalanceConfig, list[str]]:
    """(config, every bad value of it, one line each): with bad values the config is built
    unchecked (``SparseBalanceConfig.unchecked``), so that the launch checks can name what else
    is wrong (the files the flags name) in the same error; it must not be run."""
    values = {f.name: getattr(args, dest_name(f.name)) for f in dataclasses.fields(SparseBalanceConfig)}
    try:
        return SparseBalanceConfig(**values), []
    except ConfigError as e:
        return SparseBalanceConfig.unchecked(**values), list(e.problems)


def sparsebalance_flags() -> set[str]:
    """Every flag ``add_sparsebalance_args`` registers (for tests and docs)."""
    parser = add_sparsebalance_args(argparse.ArgumentParser(add_help=False))
    return {s for a in parser._actions for s in a.option_strings} - set(REMOVED_FLAGS)
