"""A mistake in a plugin setting ends the launch with one line naming the flag and its value,
before Megatron validates its flags, builds a tokenizer or starts a process group.

In-process: Megatron's own ``parse_and_validate_args`` runs with the entry's hooks and
``sys.argv`` set; its ``validate_args`` and ``set_global_variables`` (which builds the tokenizer)
are replaced by a failing stand-in, so a check that came too late fails the test. Two cases go
through the real entry with torchrun.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from sparsebalance_megatron.megatron import hooks
from tests.conftest import TINY_MODEL, run_entry

# TINY_MODEL with the vocabulary given (args_defaults would otherwise read the data for it)
BASE = [*TINY_MODEL, "--global-batch-size", "2", "--train-iters", "1", "--vocab-size", "384",
        "--sb-tokenizer", "byte"]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """Latency tables of TINY_MODEL's shape that pass every check of this machine (device and
    versions set to this run's), plus one of another depth and one of another block size."""
    from sparsebalance_megatron.latency import ModelShape, analytic_table
    from sparsebalance_megatron.latency.table import write_table
    from sparsebalance_megatron.megatron.launch.latency_setup import _run_expectation
    from sparsebalance_megatron.config import SparseBalanceConfig

    here = _run_expectation(SparseBalanceConfig())
    d = tmp_path_factory.mktemp("tables")
    out = {}
    for name, layers, block in (("good", 4, 64), ("deeper", 8, 64), ("block32", 4, 32)):
        t = analytic_table(ModelShape(num_layers=layers, hidden_size=64, ffn_hidden_size=128,
                                      num_attention_heads=4, num_query_groups=2, vocab_size=384,
                                      seq_length=256), pp=1, block_size=block,
                           transformer_impl="local")
        t["device"] = here["device"]
        t["software"] = {k: here[k] for k in ("torch", "megatron_core",
                                               "sparsebalance_megatron")}
        write_table(t, str(d / f"{name}.json"))
        out[name] = d / f"{name}.json"
    (d / "broken.json").write_text('{"format": ')
    out["broken"] = d / "broken.json"
    # a --sb-metrics-file line of a run with --seq-length 512 (BASE has 256)
    from sparsebalance_megatron.batching.packing import sequential_plan
    from sparsebalance_megatron.megatron.launch.replay import plan_record
    batch = sequential_plan([(0, 0, 100), (1, 0, 300)], dp=1, num_microbatches=2, max_tokens=512)
    (d / "plans512.jsonl").write_text(json.dumps(
        {"step": 1, "plan": plan_record(batch, 0, 1), "densities": [[[0.5], [0.5]]]}) + "\n")
    out["plans512"] = d / "plans512.jsonl"
    batch = sequential_plan([(0, 0, 100), (1, 0, 100)], dp=1, num_microbatches=2, max_tokens=256)
    (d / "plans_seed7.jsonl").write_text(json.dumps(
        {"step": 1, "plan": plan_record(batch, 0, 1, seed=7), "densities": [[[0.5], [0.5]]]}))
    out["plans_seed7"] = d / "plans_seed7.jsonl"
    return out


def launch(monkeypatch, argv: list) -> str:
    """The one ``error:`` line the entry's flow ends with, before Megatron's validation."""
    import megatron.training.arguments as margs

    def too_late(*a, **kw):
        raise AssertionError("reached Megatron's validate_args / set_global_variables")

    def no_group(*a, **kw):
        raise AssertionError("started a process group")

    monkeypatch.setattr(margs, "validate_args", too_late)
    monkeypatch.setattr(margs, "set_global_variables", too_late)
    # whatever another test of this process left initialised, the launch must start no group
    monkeypatch.setattr(torch.distributed, "init_process_group", no_group)
    monkeypatch.setattr(torch.distributed, "new_group", no_group)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_sparsebalance.py", *map(str, argv)])
    with pytest.raises(SystemExit) as e:
        margs.parse_and_validate_args(
            extra_args_provider=hooks.extra_args_provider(packed_data=True),
            args_defaults=hooks.args_defaults(packed_data=True))
    msg = str(e.value)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    return msg


def parsed(monkeypatch, argv: list):
    """Megatron's namespace as the entry's parser leaves it (the checks passed)."""
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["x.py", *map(str, argv)])
    hooks.args_defaults(packed_data=True)
    return parse_args(hooks.extra_args_provider(packed_data=True))


def _case(argv: list, needle: str):
    case = " ".join(str(a) for a in argv)
    return pytest.param(argv, needle, id=case, marks=pytest.mark.reliability(
        area="plugin flags", case=case, expect=f"one line before Megatron's validation, "
        f"tokenizer and process groups: '{needle}'"))


SB = ["--sparse-balance"]
CASES = [
    _case(["--sb-density", "1.5"], "--sb-density=1.5: expected a number in (0, 1]"),
    _case(["--sb-density", "0"], "--sb-density=0.0: expected a number in (0, 1]"),
    _case(["--sb-density", "half"], "argument --sb-density: invalid float value: 'half'"),
    _case(["--sb-block-size", "100"], "--sb-block-size=100: expected a positive power of two"),
    _case(["--sb-block-size", "0"], "--sb-block-size=0: expected a positive power of two"),
    _case(["--sb-min-density", "0.6"], "--sb-density=0.5: expected a value within "
          "[--sb-min-density, --sb-max-density] = [0.6, 1.0]"),
    _case(["--sb-min-density", "0.8", "--sb-max-density", "0.7"],
          "--sb-min-density=0.8: expected <= --sb-max-density (0.7)"),
    _case(["--sb-anchor", "top"], "argument --sb-anchor: invalid choice: 'top'"),
    _case(["--sb-selection-mode", "all"], "argument --sb-selection-mode: invalid choice: 'all'"),
    _case(["--sb-tolerance", "-1"], "--sb-tolerance=-1.0: expected a number in [0, 10]"),
    _case(["--sb-sink-blocks", "-1"], "--sb-sink-blocks=-1: expected an integer >= 0"),
    _case(["--sb-query-chunk-blocks", "0"], "--sb-query-chunk-blocks=0: expected an integer >= 1"),
    _case(["--sb-microbatch-multiple", "-4"], "--sb-microbatch-multiple='-4': expected 'auto' or an integer >= 0"),
    _case(["--sb-fault", "1:0:explode"], "--sb-fault='1:0:explode': expected RANK:STEP:KIND"),
    _case(["--sb-fault", "1:3:kill,"], "--sb-fault='1:3:kill,': expected RANK:STEP:KIND"),
    _case(["--sb-planner-timeout", "0"], "--sb-planner-timeout=0.0: expected a number of "
          "seconds > 0"),
    _case(["--sb-watchdog-seconds", "-1"], "--sb-watchdog-seconds='-1': expected 'auto'"),
    _case(["--sb-watchdog-seconds", "600"], "--sb-watchdog-seconds=600: expected fewer seconds "
          "than the distributed timeout (600 s, --distributed-timeout-minutes)"),
    _case(["--sb-raise-headroom", "0.9"], "--sb-raise-headroom='0.9': expected 'auto' or a "
          "number in [0, 0.5]"),
    _case(["--sb-straggler-slowdown", "0.5"], "--sb-straggler-slowdown=0.5: expected a number "
          "in [1, 100]"),
    _case(["--sb-calibration-ema", "0"], "--sb-calibration-ema=0.0: expected a number in (0, 1]"),
    _case(["--sb-stage-density-floor", "1.5"], "--sb-stage-density-floor=1.5: expected a number "
          "in [0, 1]"),
    _case([*SB, "--sb-latency-table", "{tmp}/none.json"],
          "--sb-latency-table {tmp}/none.json: file not found"),
    _case([*SB, "--sb-latency-table", "{broken}"], "--sb-latency-table: latency table {broken}: "
          "not valid JSON"),
    _case([*SB, "--sb-latency-table", "{deeper}"], "does not match this run: model.num_layers: "
          "table 8, this run 4"),
    _case([*SB, "--sb-latency-table", "{block32}"], "attention.block_size: table 32, this run 64"),
    _case([*SB, "--sb-quality-cost", "{tmp}/none.json"], "--sb-quality-cost {tmp}/none.json: "
          "file not found"),
    _case([*SB, "--sb-quality-cost", "{tmp}"], "--sb-quality-cost {tmp}: is a directory"),
    _case([*SB, "--sb-metrics-file", "{tmp}/no/such/dir/m.jsonl"],
          "--sb-metrics-file {tmp}/no/such/dir/m.jsonl: directory {tmp}/no/such/dir does not exist"),
    _case([*SB, "--sb-metrics-file", "{tmp}"], "--sb-metrics-file {tmp}: is a directory"),
    _case([*SB, "--sb-replay-plans", "{tmp}"], "--sb-replay-plans {tmp}: is a directory"),
    _case([*SB, "--sb-replay-plans", "{plans512}"], "--sb-replay-plans {plans512}: step 1 cannot "
          "be replayed by this run: --seq-length x --micro-batch-size: recorded 512, this run "
          "256"),
    _case([*SB, "--sb-replay-plans", "{plans_seed7}"], "--sb-replay-plans {plans_seed7}: recorded "
          "with --sb-seed 7, this run has --sb-seed 1234"),
    _case([*SB, "--sb-replay-plans", "{plans_seed7}", "--sb-seed", "7", "--train-iters", "2"],
          "--sb-replay-plans {plans_seed7}: holds step 1, this run trains --train-iters 2: "
          "step 2 not recorded"),
    _case([*SB, "--sb-data-cache-dir", "{good}"], "--sb-data-cache-dir {good}: exists and is not "
          "a directory"),
    _case([*SB, "--attention-dropout", "0.1"], "--attention-dropout 0.1 with sparse attention: "
          "its kernels apply no attention dropout"),
    _case(["--attention-dropout", "0.1"], "--attention-dropout 0.1 with the plugin's dense "
          "per-document attention"),
    _case([*SB, "--save", "{tmp}/ckpt"], "--save {tmp}/ckpt without --save-interval"),
    _case([*SB, "--save", "{tmp}/ckpt", "--save-interval", "0"],
          "--save-interval 0: expected an integer >= 1"),
]


def _fill(s: str, tmp_path, tables) -> str:
    return str(s).format(tmp=tmp_path, **{k: v for k, v in tables.items()})


@pytest.mark.parametrize("argv, needle", CASES)
def test_a_bad_plugin_setting_ends_the_launch_in_one_line(argv, needle, tmp_path, tables,
                                                          monkeypatch):
    # TINY_MODEL gives --attention-dropout 0: the dropout cases give theirs after it
    msg = launch(monkeypatch, [*BASE, *(_fill(a, tmp_path, tables) for a in argv)])
    assert _fill(needle, tmp_path, tables) in msg, msg


@pytest.mark.reliability(area="plugin flags", case="three bad values at once (--sb-density "
                         "1.5 --sb-block-size 100 --sb-fault 1:0:explode) and a missing "
                         "--sb-latency-table", expect="one line naming all four, before "
                         "Megatron's validation, tokenizer and process groups")
def test_every_bad_value_is_named_at_once(monkeypatch, tmp_path):
    from sparsebalance_megatron.config import ConfigError, SparseBalanceConfig

    values = ["--sb-density=1.5: expected a number in (0, 1]",
              "--sb-block-size=100: expected a positive power of two",
              "--sb-fault='1:0:explode': expected RANK:STEP:KIND"]
    msg = launch(monkeypatch, [*BASE, *SB, "--sb-density", "1.5", "--sb-block-size", "100",
                               "--sb-fault", "1:0:explode",
                               "--sb-latency-table", tmp_path / "none.json"])
    for needle in values + [f"--sb-latency-table {tmp_path}/none.json: file not found"]:
        assert needle in msg, (needle, msg)
    with pytest.raises(ConfigError) as e:             # the config alone, as a library user meets it
        SparseBalanceConfig(density=1.5, block_size=100, fault="1:0:explode")
    assert len(e.value.problems) == 3
    assert all(any(v in p for p in e.value.problems) for v in values), e.value.problems


def test_a_good_launch_passes_the_checks(monkeypatch, tables, tmp_path):
    args = parsed(monkeypatch, [*BASE, *SB, "--sb-latency-table", tables["good"],
                                "--sb-metrics-file", tmp_path / "m.jsonl",
                                "--save", tmp_path / "ckpt", "--save-interval", "2"])
    assert args.sb_latency_table == str(tables["good"]) and args.attention_dropout == 0.0
    # another table is refused unless forced
    parsed(monkeypatch, [*BASE, *SB, "--sb-latency-table", tables["deeper"],
                         "--sb-latency-table-force"])


def test_attention_dropout_defaults_to_zero_with_the_plugins_attention(monkeypatch):
    """Megatron's default --attention-dropout 0.1 would be silently ignored by the plugin's
    kernels: their default is 0; Megatron's stays where its own attention runs."""
    model = BASE[:BASE.index("--attention-dropout")] + BASE[BASE.index("--attention-dropout") + 2:]
    assert "--attention-dropout" not in model
    assert parsed(monkeypatch, [*model, *SB]).attention_dropout == 0.0
    assert parsed(monkeypatch, [*model, "--sb-sparse-attention"]).attention_dropout == 0.0
    assert parsed(monkeypatch, model).attention_dropout == 0.0   # our entry: dense varlen
    te = [*model, "--transformer-impl", "transformer_engine"]
    from sparsebalance_megatron.megatron.launch import checks   # as where TE is installed (else
    monkeypatch.setattr(checks, "have_module", lambda name: True)   # refused at parse)
    assert parsed(monkeypatch, te).attention_dropout == 0.1      # Megatron's own attention
    assert parsed(monkeypatch, [*model, *SB, "--attention-dropout", "0"]).attention_dropout == 0


@pytest.mark.parametrize("argv, needle", [
    (["--sb-density", "1.5"], "error: --sb-density=1.5: expected a number in (0, 1]"),
    ([*SB, "--sb-latency-table", "missing.json"],
     "error: --sb-latency-table missing.json: file not found"),
], ids=["density", "latency-table"])
@pytest.mark.reliability(area="plugin flags", case="--sb-density 1.5; a missing "
                         "--sb-latency-table, through torchrun and the training entry",
                         expect="one line naming the flag; no tokenizer, no process group")
def test_the_entry_names_the_flag_before_megatron_builds_anything(argv, needle, tmp_path):
    proc = run_entry(1, [*BASE, *argv], cwd=tmp_path, timeout=180, check=False)
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    assert [ln for ln in out.splitlines() if ln.startswith("error:")] == [needle], out[-3000:]
    rank = out.split("torch/distributed/elastic")[0]        # the rank's output, not torchrun's
    assert needle in rank, out[-3000:]
    for sign in ("building", "tokenizer", "initializing torch distributed", "Traceback"):
        assert sign not in rank, f"{sign!r} in the output: Megatron got past the plugin's checks"
