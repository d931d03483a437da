"""--sb-dense-below-tokens and --sb-dense-kernel: the routing threshold is the latency table's
measured crossover unless a number is given; bad values name the flag and the value."""

import argparse

import pytest

from sparsebalance_megatron.arguments import add_sparsebalance_args, config_from_args
from sparsebalance_megatron.config import ConfigError, SparseBalanceConfig


def parse(argv):
    return config_from_args(add_sparsebalance_args(argparse.ArgumentParser()).parse_args(argv))


@pytest.mark.parametrize("argv,table,want", [
    ([], None, 0),                                   # auto, no table: no routing
    ([], 1536, 1536),                                # auto: the table's crossover
    (["--sb-dense-below-tokens", "0"], 1536, 0),     # never route
    (["--sb-dense-below-tokens", "2048"], 1536, 2048),
    (["--sb-dense-below-tokens", "2048"], None, 2048),
])
def test_threshold_is_the_flag_else_the_table_crossover(argv, table, want):
    assert parse(argv).routing_threshold(table) == want


@pytest.mark.parametrize("value", ["-5", "1.5", "2k", "²", ""])
def test_bad_threshold_names_the_flag_and_the_value(value):
    with pytest.raises(ConfigError, match=rf"--sb-dense-below-tokens={value!r}: expected 'auto'"):
        parse(["--sb-dense-below-tokens", value])
    for bad in (-1, True, 2.0):
        with pytest.raises(ConfigError, match=rf"--sb-dense-below-tokens={bad!r}"):
            SparseBalanceConfig(dense_below_tokens=bad)


def test_bad_dense_kernel_names_the_flag_and_the_value(capsys):
    with pytest.raises(SystemExit):
        parse(["--sb-dense-kernel", "cudnn"])
    assert "--sb-dense-kernel" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--sb-dense-kernel='cudnn': expected one of auto, "):
        SparseBalanceConfig(dense_kernel="cudnn")
    assert parse(["--sb-dense-kernel", "sdpa"]).dense_kernel == "sdpa"
