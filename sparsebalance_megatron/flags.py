"""The flag reference, docs/FLAGS.md, generated from ``SparseBalanceConfig``.

    python -m sparsebalance_megatron.flags --markdown > docs/FLAGS.md     # make flags

A unit test checks that docs/FLAGS.md is what this prints, so the page never drifts from the
flags. This module must not import megatron or torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re

from . import config
from .arguments import field_type, add_sparsebalance_args
from .config import SparseBalanceConfig, flag_name

HEADER = """# Flags

Every `--sparse-balance` / `--sb-*` flag with its type, default and help, generated from
`SparseBalanceConfig` (`sparsebalance_megatron/config.py`) by `make flags`
(`python -m sparsebalance_megatron.flags --markdown > docs/FLAGS.md`): edit the field's help
there, not this page. The README names the five flags most runs touch. Megatron's own flags are
Megatron's (`examples/pretrain_gpt_sparsebalance.py --help` lists both)."""


def _sections() -> dict[str, str]:
    """Each field's section, read from the ``# --- name ---`` comments above the fields in
    config.py (the dataclass keeps no grouping of its own)."""
    sections, current = {}, "other"
    for line in inspect.getsource(config.SparseBalanceConfig).splitlines():
        head = re.match(r"\s*# --- (.+?) -+\s*$", line)
        if head:
            current = head.group(1)
            continue
        fld = re.match(r"\s{4}(\w+): [\w\[\]]+ = _f\(", line)
        if fld:
            sections[fld.group(1)] = current
    return sections


def _describe(f: dataclasses.Field) -> str:
    typ = field_type(f).__name__
    if typ == "bool":
        kind = "switch"
    else:
        kind = f"{typ}, default " + ("none" if f.default is None else f"`{f.default}`")
    if "choices" in f.metadata:
        kind += "; one of " + ", ".join(f"`{c}`" for c in f.metadata["choices"])
    if f.metadata.get("path"):
        kind += f"; a path ({f.metadata['path']})"
    return f"- `{flag_name(f.name)}` ({kind}): {f.metadata['help']}"


def flags_markdown() -> str:
    """Every flag, grouped as config.py groups the fields, in declaration order."""
    sections, out, current = _sections(), [HEADER], None
    for f in dataclasses.fields(SparseBalanceConfig):
        sec = sections.get(f.name, "other")
        if sec != current:
            current = sec
            out += ["", f"## {sec[:1].upper() + sec[1:]}", ""]
        out.append(_describe(f))
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Print the SparseBalance flags: with --markdown the reference docs/FLAGS.md "
        "holds, else argparse's help for them.")
    parser.add_argument("--markdown", action="store_true", help="the Markdown reference")
    if parser.parse_args(argv).markdown:
        print(flags_markdown(), end="")
    else:
        add_sparsebalance_args(argparse.ArgumentParser(prog="flags", add_help=False)).print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
