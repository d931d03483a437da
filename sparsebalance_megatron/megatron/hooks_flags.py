"""The hooks' parse-time half: Megatron's ``extra_args_provider`` and ``args_defaults`` (the first two
of the six calls ``hooks`` documents; ``hooks`` exports them). They run before Megatron parses or
validates its flags, before any process group: a bad plugin setting or a launch conflict the
flags alone show ends the launch here with one ``error:`` line, said once per job
(``runtime.refusal``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, Optional

from ..arguments import add_sparsebalance_args
from ..config import ConfigError
from .launch import compat
from .launch.checks import LaunchError, cpu_parser_defaults, flag_conflicts
from .launch.data_checks import PER_SPLIT_DATA, WHOLE_DATA
from .launch.preflight import OneLineParser, check_after_parse, checked_config, uses_plugin_data
from .runtime.refusal import refusal


MODELS = ("gpt", "hybrid")


def extra_args_provider(base: Optional[Callable] = None, *, packed_data: Optional[bool] = None,
                        model: Optional[str] = None) -> Callable:
    """Megatron ``extra_args_provider``: ``base``'s flags (if any), then ours; without CUDA also
    the CPU defaults, and the CPU shims (``validate_args`` already queries the device). The
    parser it returns checks the plugin's settings and the launch conflicts of Megatron's flags
    as soon as it has parsed them, before Megatron validates and prints the flags or builds the
    tokenizer (``preflight.check_parsed``; with the plugin's attention the default
    ``--attention-dropout`` becomes 0). ``packed_data`` as for ``install``; ``model``: the
    script's model, ``"gpt"`` or ``"hybrid"`` (the checks of a pattern against the model run at
    parse; None: they wait for ``install``)."""
    if model not in (None, *MODELS):
        raise ValueError(f"model={model!r}: expected one of {MODELS} or None")
    conflicts = functools.partial(flag_conflicts, hybrid=None if model is None
                                  else model == "hybrid")

    def provider(parser):
        if base is not None:
            parser = base(parser)
        compat.activate_cpu_shims()
        compat.warn_untested_versions()
        cpu_parser_defaults(parser)
        _escape_help_percent(parser)
        add_sparsebalance_args(parser)
        check_after_parse(parser, packed_data, conflicts)
        return parser

    return provider


def _escape_help_percent(parser) -> None:
    """megatron-core 0.19.2 has a stray '%' in --moe-paged-stash-buffer-size-factor-cuda's help,
    which makes ``--help`` crash; escape lone '%'."""
    import re

    for action in parser._actions:
        if action.help:
            action.help = re.sub(r"%%|%\(\w+\)[a-z]|%",
                                 lambda m: m.group(0) if len(m.group(0)) > 1 else "%%",
                                 action.help)


def args_defaults(base: Optional[dict] = None, *, packed_data: Optional[bool] = None,
                  argv=None) -> dict:
    """``args_defaults`` for ``parse_and_validate_args``: ``base``, except that with the plugin's
    data path and its tokenizer (Megatron's ``NullTokenizer``, the default there) the vocabulary
    size is the data's, so ``--vocab-size`` need not be given."""
    out = dict(base or {})
    parser = OneLineParser(add_help=False, allow_abbrev=False)
    add_sparsebalance_args(parser)
    for flag in ("--tokenizer-type", "--split", "--seed"):
        parser.add_argument(flag)
    parser.add_argument("--vocab-size", type=int)
    for flag, _ in WHOLE_DATA + PER_SPLIT_DATA:       # a list, or the file that holds it
        parser.add_argument(flag, nargs=None if flag.endswith("-args-path") else "*")
    try:
        # The plugin's flags first of all (this runs before Megatron parses anything): one line
        # naming the flag and value, before Megatron's tokenizer or data would trip over it.
        ns, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
        sb = checked_config(ns)
    except (ConfigError, LaunchError) as e:
        raise refusal(f"error: {e}") from None
    if not uses_plugin_data(sb, packed_data):
        return out
    out.setdefault("eval_interval", 1000)   # Megatron's sample count needs one; its old default
    if ns.tokenizer_type not in (None, "NullTokenizer"):
        return out   # a Megatron text tokenizer: it decides the vocabulary
    out["tokenizer_type"] = "NullTokenizer"
    if ns.vocab_size is not None:
        return out
    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        return out   # argparse prints the help and exits before any default is read
    from .step.data import load_data

    try:
        data = load_data(argparse.Namespace(tokenizer_type=None, split=ns.split, **{
            dest: getattr(ns, dest) for _, dest in WHOLE_DATA + PER_SPLIT_DATA}), sb)
    except (ValueError, OSError) as e:
        # Megatron's parse would fail next on NullTokenizer without a vocabulary size, hiding
        # the cause: say it here.
        raise refusal(f"error: {e}") from None
    out.update(tokenizer_type="NullTokenizer", vocab_size=int(data.corpus.vocab_size))
    return out
