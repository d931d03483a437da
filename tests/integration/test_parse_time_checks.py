"""User mistakes named as Megatron parses the flags, before it validates and prints its arguments.

The parser ``hooks.extra_args_provider(..., model=...)`` hands Megatron runs the launch conflicts
the flags show (``launch.checks.flag_conflicts``) as soon as it has parsed them: a mistake ends
the launch in one ``error: cannot launch: ...`` line, never after Megatron's
``------------------------ arguments ------------------------`` block, its padded vocabulary or
its tokenizer. Always run: each mistake through Megatron's own ``parse_and_validate_args`` with
the entries' provider, in process (parse only), and one through the GPT entry as a process.
With ``MEGATRON_LM_MAIN_DIR`` / ``MEGATRON_LM_DEV_DIR``: the same mistakes through that checkout's
patched ``pretrain_gpt.py`` / ``pretrain_hybrid.py``, as a user runs them; on dev also
``--sequence-packing-scheduler`` with the plugin's packing (two packers).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_megatron_patch import patched_copy

pytestmark = pytest.mark.integration

ARGS_BANNER = "------------------------ arguments ------------------------"
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1",
         "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]

# (id, the script's model, flags, what the one line must name)
MISTAKES = [
    ("cp-comm-type p2p", "gpt",
     ["--sparse-balance", "--context-parallel-size", "2", "--cp-comm-type", "p2p"],
     "--cp-comm-type p2p with --context-parallel-size 2"),
    ("transformer-engine without TE", "gpt",
     ["--sparse-balance", "--transformer-impl", "transformer_engine"],
     "--transformer-impl transformer_engine: transformer-engine is not installed"),
    ("M layer in a hybrid pattern", "hybrid",
     ["--sparse-balance", "--hybrid-layer-pattern", "*M*-"],
     "layer kind(s) 'M' (Mamba) not supported"),
    ("hybrid pattern to the GPT script", "gpt",
     ["--sparse-balance", "--hybrid-layer-pattern", "*-*-"],
     "--hybrid-layer-pattern '*-*-' with a GPT model"),
    ("MoE with sparse attention", "gpt",
     ["--sb-sparse-attention", "--num-experts", "4"], "--num-experts 4 (MoE block spec)"),
    ("micro-batch size 2 with packed data", "gpt",
     ["--sparse-balance", "--micro-batch-size", "2"], "--micro-batch-size 2"),
]


def _refusal(argv: list, model: str, capsys, monkeypatch, *, extra_flags=None) -> str:
    """Megatron's parse_and_validate_args, as the patched scripts call it, on ``argv``; returns
    the one line it ended with (nothing of Megatron's validation printed before it)."""
    from megatron.training.arguments import parse_and_validate_args

    from sparsebalance_megatron.megatron import hooks

    base = None
    if extra_flags:
        def base(parser):
            for flag, kw in extra_flags.items():
                parser.add_argument(flag, **kw)
            return parser
    monkeypatch.setattr(sys, "argv", ["pretrain_x.py", *argv])
    with pytest.raises(SystemExit) as e:
        parse_and_validate_args(
            extra_args_provider=hooks.extra_args_provider(base, model=model),
            args_defaults=hooks.args_defaults({"tokenizer_type": "GPT2BPETokenizer"}))
    out = capsys.readouterr()
    msg = str(e.value)
    assert msg.startswith("error: cannot launch: ") and "\n" not in msg, msg
    assert ARGS_BANNER not in out.out + out.err and "padded vocab" not in out.out + out.err
    return msg


def _marked(case, model, flags, needle):
    return pytest.param(case, model, flags, needle, id=case, marks=pytest.mark.reliability(
        area="launch", case=f"{case}: {' '.join(flags)} (pretrain_{model}.py)",
        expect=f"refused as the flags are parsed, before Megatron prints its arguments: "
               f"'{needle}'"))


@pytest.mark.parametrize("case, model, flags, needle", [_marked(*m) for m in MISTAKES])
def test_a_mistake_is_named_as_the_flags_are_parsed(case, model, flags, needle, capsys,
                                                    monkeypatch):
    assert needle in _refusal([*MODEL, *flags], model, capsys, monkeypatch)


def test_a_quality_refresh_it_cannot_serve_is_refused_as_the_flags_are_parsed(capsys,
                                                                              monkeypatch):
    """--sb-quality-refresh-interval refreshes the quality objective's model: with the density
    objective there is none to refresh, and the launch ends in one line before Megatron's."""
    msg = _refusal([*MODEL, "--sparse-balance", "--sb-dst-objective", "density",
                    "--sb-quality-refresh-interval", "10"], "gpt", capsys, monkeypatch)
    assert "--sb-quality-refresh-interval 10 without DST's quality objective" in msg


def test_the_same_flags_without_the_mistake_parse(monkeypatch):
    """The checks refuse the mistake, not the launch: a good GPT and hybrid set of flags parses."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from sparsebalance_megatron.megatron import hooks

    for model, flags in (("gpt", ["--sparse-balance"]),
                         ("hybrid", ["--sparse-balance", "--hybrid-layer-pattern", "*-*-"]),
                         ("gpt", ["--sparse-balance", "--context-parallel-size", "2",
                                  "--cp-comm-type", "a2a"])):
        parser = hooks.extra_args_provider(None, model=model)(
            add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
        parser.parse_args([*MODEL, *flags])


def test_what_megatrons_validation_may_change_waits_for_install():
    """A flag Megatron's validation may still undo is not refused at parse (a safety check never
    harms a healthy launch): the distributed optimizer on a CPU (--freeze-all-layers turns it
    off); the deprecated --hybrid-override-pattern counts as the pattern."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from sparsebalance_megatron.megatron import hooks
    from sparsebalance_megatron.megatron.launch.checks import LaunchError, check_launch
    from sparsebalance_megatron.config import SparseBalanceConfig

    def parser(model):
        return hooks.extra_args_provider(None, model=model)(
            add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))

    args = parser("gpt").parse_args([*MODEL, "--sb-batching", "--use-distributed-optimizer"])
    with pytest.raises(LaunchError, match="--use-distributed-optimizer on CPU"):
        check_launch(args, SparseBalanceConfig(batching=True), plugin_data=True)   # validated
    parser("hybrid").parse_args([*MODEL, "--sparse-balance", "--hybrid-override-pattern", "*-"])
    with pytest.raises(SystemExit, match="'M' \\(Mamba\\)"):
        parser("hybrid").parse_args([*MODEL, "--sparse-balance", "--hybrid-override-pattern",
                                     "*M"])


def test_an_unknown_model_leaves_the_pattern_checks_to_install(monkeypatch):
    """A hand-wired script that does not say its model: the pattern cannot be judged at parse
    (hooks.install judges it on the model config), the other mistakes still are."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from sparsebalance_megatron.megatron import hooks

    parser = hooks.extra_args_provider(None)(
        add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    parser.parse_args([*MODEL, "--sparse-balance", "--hybrid-layer-pattern", "*-*-"])
    with pytest.raises(SystemExit, match="--cp-comm-type p2p"):
        parser.parse_args([*MODEL, "--sparse-balance", "--context-parallel-size", "2",
                           "--cp-comm-type", "p2p"])
    with pytest.raises(ValueError, match="model='mamba'"):
        hooks.extra_args_provider(None, model="mamba")


SCHEDULER = {"--sequence-packing-scheduler": dict(choices=["dp_balanced", "default_dynamic_cp"],
                                                  default=None)}


@pytest.mark.reliability(area="launch", case="two packers: Megatron-LM dev's "
                         "--sequence-packing-scheduler dp_balanced with the plugin's packing",
                         expect="refused as the flags are parsed, one line naming which to drop")
@pytest.mark.parametrize("ours", [["--sparse-balance"], ["--sb-batching"], ["--sb-dst"]])
def test_two_packers_are_refused_at_parse(ours, capsys, monkeypatch):
    """Megatron-LM dev's --sequence-packing-scheduler (added here as dev's parser has it) with the
    plugin's packing: one line naming both and which to drop."""
    msg = _refusal([*MODEL, *ours, "--sequence-packing-scheduler", "dp_balanced"], "gpt", capsys,
                   monkeypatch, extra_flags=SCHEDULER)
    assert f"--sequence-packing-scheduler dp_balanced with the plugin's packing ({ours[0]})" in msg
    assert "two packers" in msg and "drop --sequence-packing-scheduler" in msg


def test_megatrons_packer_alone_is_left_alone(monkeypatch):
    """Without the plugin's packing there is one packer: Megatron's (stock, or beside the static
    sparse attention on Megatron's data path)."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from sparsebalance_megatron.megatron import hooks

    parser = hooks.extra_args_provider(None, model="gpt")(
        add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    parser.add_argument("--sequence-packing-scheduler", default=None)
    for flags in ([], ["--sb-sparse-attention"]):
        parser.parse_args([*MODEL, *flags, "--sequence-packing-scheduler", "dp_balanced"])


def test_the_gpt_entry_names_a_mistake_before_megatrons_arguments(tmp_path):
    """examples/pretrain_gpt_sparsebalance.py as a process: the hybrid pattern is named in one
    line, with nothing of Megatron's validation (its arguments, padded vocabulary) before it."""
    from tests.conftest import run_entry      # one rank, forked: megatron-core imported once

    proc = run_entry(1, [*MODEL, "--hybrid-layer-pattern", "*-*-"], cwd=tmp_path, check=False)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("error: cannot launch:")]
    assert len(lines) == 1 and "--hybrid-layer-pattern '*-*-' with a GPT model" in lines[0], \
        proc.stdout[-3000:]
    assert ARGS_BANNER not in proc.stdout and "padded vocab" not in proc.stdout
    assert "Traceback" not in proc.stdout


# --- real Megatron-LM checkouts, patched ---------------------------------------------------------

def _run_checkout_script(script: Path, argv: list, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, str(script), *argv], cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0, proc.stdout[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    assert ARGS_BANNER not in proc.stdout and "padded vocab" not in proc.stdout, \
        proc.stdout[-3000:]
    return lines[0]


@pytest.mark.parametrize("branch", ["main", "dev"])
def test_patched_checkout_names_each_mistake_before_megatrons_arguments(branch, tmp_path):
    """The four mistakes of issue 42 (and the two the same checks now catch at parse), through the
    branch's patched pretrain_gpt.py / pretrain_hybrid.py, each a process that only parses."""
    copy = patched_copy(branch, tmp_path, ("pretrain_gpt.py", "pretrain_hybrid.py",
                                           "gpt_builders.py", "hybrid_builders.py",
                                           "model_provider.py"))
    for case, model, flags, needle in MISTAKES:
        script = copy / f"pretrain_{model}.py"
        line = _run_checkout_script(script, [*MODEL, *flags], tmp_path)
        assert line.startswith("error: cannot launch:") and needle in line, (case, line)


def test_patched_dev_refuses_its_packing_scheduler_with_the_plugins(tmp_path):
    """Megatron-LM dev: --sequence-packing-scheduler dp_balanced with --sparse-balance or
    --sb-batching ends the launch at parse, in one line, before Megatron's own scheduler checks
    (its transformer-engine >= 2.9 check) and far before train_step."""
    copy = patched_copy("dev", tmp_path, ("pretrain_gpt.py", "gpt_builders.py",
                                          "model_provider.py"))
    for ours in ("--sparse-balance", "--sb-batching"):
        line = _run_checkout_script(copy / "pretrain_gpt.py",
                                    [*MODEL, ours, "--sequence-packing-scheduler", "dp_balanced",
                                     "--max-seqlen-per-dp-cp-rank", "256"], tmp_path)
        assert f"--sequence-packing-scheduler dp_balanced with the plugin's packing ({ours})" \
            in line and "two packers" in line, line
