"""CLI flags generated from SparseBalanceConfig: same set as the fields, round trip, clear errors,
and no collision with Megatron's own parser."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from sparsebalance_megatron.arguments import (
    add_sparsebalance_args,
    config_from_args,
    sparsebalance_flags,
)
from sparsebalance_megatron.config import ConfigError, SparseBalanceConfig, dest_name, flag_name

FIELDS = dataclasses.fields(SparseBalanceConfig)


def parse(argv: list[str]) -> SparseBalanceConfig:
    return config_from_args(add_sparsebalance_args(argparse.ArgumentParser()).parse_args(argv))


def _candidates(f: dataclasses.Field) -> list:
    choices = f.metadata.get("choices")
    if choices:
        return [c for c in choices if c != f.default]
    if isinstance(f.default, bool):
        return [not f.default]
    if f.name == "fault":                   # RANK:STEP:KIND
        return ["1:3:raise"]
    if f.default is None:
        return [f"/tmp/sb-{f.name}"]
    if isinstance(f.default, float):
        return [f.default / 2, f.default * 2, 0.5, 2.0, f.default + 1]
    if isinstance(f.default, int):
        return [f.default + 2, f.default + 1, f.default * 2, 0, 1]
    if f.default == "auto":                 # 'auto' or a number (--sb-raise-headroom)
        return ["0.1", "0"]
    raise AssertionError(f"no non-default value rule for {f.name}={f.default!r}")


def _non_default(f: dataclasses.Field):
    """A valid value different from the field's default, derived from its type and choices."""
    for v in _candidates(f):
        if v == f.default:
            continue
        try:
            SparseBalanceConfig(**{f.name: v})
        except ConfigError:
            continue
        return v
    raise AssertionError(f"no valid non-default value found for {f.name}")


def _full_non_default() -> dict:
    values = {f.name: _non_default(f) for f in FIELDS}
    # Cross-field rules: min <= density <= max, a power-of-two block size.
    values.update(density=0.25, min_density=0.0625, max_density=0.75, block_size=128)
    return values


def test_flags_are_exactly_the_fields():
    flags = sparsebalance_flags()
    assert flags == {flag_name(f.name) for f in FIELDS}
    assert len(flags) == len(FIELDS)
    parser = add_sparsebalance_args(argparse.ArgumentParser())
    dests = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"
             and not a.dest.startswith("_removed_")}      # REMOVED_FLAGS: refused, no field
    assert dests == {dest_name(f.name) for f in FIELDS}


def test_every_field_has_help_text():
    parser = add_sparsebalance_args(argparse.ArgumentParser())
    helps = {a.dest: a.help for a in parser._actions}
    for f in FIELDS:
        assert len(f.metadata.get("help", "").strip()) > 10, f"{f.name} has no help text"
        assert helps[dest_name(f.name)] == f.metadata["help"].replace("%", "%%")  # argparse escapes


def test_defaults_parse_to_the_default_config():
    assert parse([]) == SparseBalanceConfig()


def test_non_default_values_round_trip():
    values = _full_non_default()
    argv = []
    for f in FIELDS:
        v = values[f.name]
        if isinstance(f.default, bool):
            argv += [flag_name(f.name)] if v else []
        else:
            argv += [flag_name(f.name), str(v)]
    cfg = parse(argv)
    expected = SparseBalanceConfig(**values)
    assert cfg == expected
    for f in FIELDS:
        assert getattr(cfg, f.name) != f.default, f"{f.name} kept its default"


@pytest.mark.parametrize("argv, flag, value", [
    (["--sb-density", "0"], "--sb-density", "0.0"),
    (["--sb-density", "1.5"], "--sb-density", "1.5"),
    (["--sb-min-density", "0.5", "--sb-max-density", "0.25", "--sb-density", "0.25"],
     "--sb-min-density", "0.5"),
    (["--sb-block-size", "48"], "--sb-block-size", "48"),
    (["--sb-block-size", "0"], "--sb-block-size", "0"),
    (["--sb-tolerance", "-1"], "--sb-tolerance", "-1"),
    (["--sb-raise-headroom", "0.6"], "--sb-raise-headroom", "0.6"),
    (["--sb-raise-headroom", "fast"], "--sb-raise-headroom", "fast"),
    (["--sb-exchange-rate", "cheap"], "--sb-exchange-rate", "cheap"),
    (["--sb-exchange-rate", "-0.1"], "--sb-exchange-rate", "-0.1"),
    (["--sb-exchange-rate", "inf"], "--sb-exchange-rate", "inf"),
    (["--sb-watchdog-seconds", "-3"], "--sb-watchdog-seconds", "-3"),
    (["--sb-microbatch-multiple", "-1"], "--sb-microbatch-multiple", "-1"),
    (["--sb-profile-timeout-minutes", "0"], "--sb-profile-timeout-minutes", "0.0"),
    (["--sb-profile-timeout-minutes", "-5"], "--sb-profile-timeout-minutes", "-5.0"),
    (["--sb-profile-timeout-minutes", "inf"], "--sb-profile-timeout-minutes", "inf"),
])
def test_bad_values_name_the_flag_and_the_value(argv, flag, value):
    with pytest.raises(ConfigError) as e:
        parse(argv)
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert flag in msg and value in msg, msg


@pytest.mark.parametrize("argv, flag, value", [
    (["--sb-anchor", "avg"], "--sb-anchor", "avg"),
    (["--sb-anchor", "median"], "--sb-anchor", "median"),      # removed (issue 85): mean or max
    (["--sb-attention-backend", "cudnn"], "--sb-attention-backend", "cudnn"),
    (["--sb-stand-down", "sab"], "--sb-stand-down", "sab"),
])
def test_bad_choices_name_the_flag_and_the_value(argv, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and value in err, err


@pytest.mark.parametrize("field, value", [("anchor", "avg"), ("anchor", "min"),
                                          ("attention_backend", "cudnn"),
                                          ("stand_down", "on")])
def test_bad_choices_in_the_config_name_the_flag_and_the_value(field, value):
    with pytest.raises(ConfigError, match=f"{flag_name(field)}={value!r}"):
        SparseBalanceConfig(**{field: value})


def test_no_collision_with_megatron_flags():
    from megatron.training.arguments import add_megatron_arguments

    megatron = add_megatron_arguments(argparse.ArgumentParser())
    theirs = {s for a in megatron._actions for s in a.option_strings}
    theirs_dest = {a.dest for a in megatron._actions}
    assert not (sparsebalance_flags() & theirs)
    assert not ({dest_name(f.name) for f in FIELDS} & theirs_dest)

    parser = add_sparsebalance_args(megatron)  # argparse raises on any conflicting option
    args = parser.parse_args(["--sparse-balance", "--sb-density", "0.25", "--num-layers", "2"])
    assert args.sparse_balance is True and args.sb_density == 0.25 and args.num_layers == 2
    cfg = config_from_args(args)
    assert cfg.density == 0.25 and cfg.sparse_attention_enabled and cfg.dst_enabled


def test_a_removed_flag_is_refused_with_what_replaces_it(capsys):
    import argparse

    from sparsebalance_megatron.arguments import REMOVED_FLAGS, add_sparsebalance_args

    parser = add_sparsebalance_args(argparse.ArgumentParser(prog="train"))
    for flag, replacement in REMOVED_FLAGS.items():
        with pytest.raises(SystemExit):
            parser.parse_args([flag])
        err = capsys.readouterr().err
        assert f"{flag} was replaced by {replacement}" in err
    args = parser.parse_args([])                  # a launch without them parses as before
    assert not any(k.startswith("_removed_") for k in vars(args))
