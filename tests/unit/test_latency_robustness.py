"""Latency tables and calibration against bad inputs: degenerate values, oversized files, tables
from another execution setup (TP, transformer implementation, recomputation), outlier and
unusable timings. Every case is listed in RELIABILITY.md (the ``reliability`` marker)."""

import json
import math
import os

import numpy as np
import pytest

from sparsebalance_megatron.latency import (LatencyModel, LatencyTableError, LatencyTableMismatch,
                                            ModelShape, analytic_table, read_table)
from sparsebalance_megatron.latency import table as table_mod
from sparsebalance_megatron.latency.model import CALIBRATION_CLIP
from sparsebalance_megatron.latency.table import MAX_TABLE_BYTES, validate_table
from tests.unit.conftest import write_table


def rel(area, case, expect):
    return pytest.mark.reliability(area=area, case=case, expect=expect)


def case(mutate, needle, id, what, expect):
    return pytest.param(mutate, needle, id=id, marks=rel("latency table", what, expect))


def _set_coef(kind, part, values):
    return lambda t: t["coefficients"][kind].__setitem__(part, values)


def _set_time(i, key, value):
    return lambda t: t["measurements"][i].__setitem__(key, value)


DEGENERATE = [
    case(_set_coef("first", "fwd", [0.0, 0.0, 0.0, 0.0, 0.0]),
         r"'coefficients.first.fwd': \[0.0, 0.0, 0.0, 0.0, 0.0\]: all zero", "zero-coef",
         "all-zero coefficients", "refused: error names the table, the coefficient and its value"),
    case(lambda t: t["coefficients"]["last"]["bwd"].__setitem__(2, -1e-6),
         r"'coefficients.last.bwd\[2\]': -1e-06 \(seconds per unit of attention_work\): "
         r"expected >= 0", "negative-coef", "a negative work coefficient",
         "refused: error names the coefficient, its value and '>= 0'"),
    case(_set_coef("first", "bwd", [-1.0, 0.0, 0.0, 0.0, 0.0]),
         r"'coefficients.first': predict -[0-9.]+ s \(forward \+ backward\) for "
         r"measurements\[\d+\] \(\d+ document\(s\), \d+ tokens, density [0-9.]+\): expected "
         r"more than 0 s",
         "negative-intercept", "a negative intercept that makes every time <= 0",
         "refused: error names the stage's coefficients and the measurement predicted <= 0 s"),
    case(lambda t: t["coefficients"]["first"]["fwd"].__setitem__(1, float("nan")),
         r"'coefficients.first.fwd': \[.*nan.*\]: expected 5 finite numbers", "nan-coef",
         "a NaN coefficient", "refused: error names the coefficient list"),
    case(lambda t: t["coefficients"]["first"]["fwd"].__setitem__(2, float("inf")),
         r"'coefficients.first.fwd': \[.*inf.*\]: expected 5 finite numbers", "inf-coef",
         "an infinite coefficient", "refused: error names the coefficient list"),
    case(lambda t: t["coefficients"]["last"]["fwd"].__setitem__(1, 1e300),
         r"'coefficients.last.fwd': \[.*1e\+300.*\] predicts [0-9.e+]+ s for measurements\[\d+\]"
         r".*expected at most 1e\+06 s", "huge-coef", "a 1e300 s/token coefficient",
         "refused: error names the coefficient, the predicted time and the 1e6 s bound"),
    case(lambda t: t["coefficients"]["last"]["fwd"].__setitem__(0, 1e300),
         r"'coefficients.last.fwd\[0\]': 1e\+300 s \(const\): expected at most 1e\+06 s",
         "huge-const", "a 1e300 s intercept", "refused: error names the coefficient and the bound"),
    case(_set_time(3, "fwd_s", -1.0), r"'measurements\[3\].fwd_s': -1.0: expected a measured "
         r"time in seconds in \(0, 1e\+06\]", "negative-time", "a negative measured time",
         "refused: error names the measurement, the value and the range"),
    case(_set_time(0, "bwd_s", 0.0), r"'measurements\[0\].bwd_s': 0.0: expected", "zero-time",
         "a zero measured time", "refused: error names the measurement and the value"),
    case(_set_time(5, "fwd_s", float("nan")), r"'measurements\[5\].fwd_s': nan: expected",
         "nan-time", "a NaN measured time", "refused: error names the measurement and the value"),
    case(_set_time(5, "bwd_s", float("inf")), r"'measurements\[5\].bwd_s': inf: expected",
         "inf-time", "an infinite measured time", "refused: error names the measurement"),
    case(_set_time(1, "fwd_s", 1e300), r"'measurements\[1\].fwd_s': 1e\+300: expected",
         "huge-time", "a 1e300 s measured time", "refused: error names the measurement and value"),
    case(_set_time(1, "fwd_s", 10 ** 400), r"'measurements\[1\].fwd_s': 1000.*: expected",
         "400-digit-time", "a 400-digit integer time", "refused: error names the measurement"),
    case(lambda t: t.__setitem__("measurements",
                                 [m for m in t["measurements"] if m["kind"] == "last"]),
         r"'measurements': no measurement for stage kind\(s\) \['first'\]: expected at least one",
         "missing-stage", "no measurements for one pipeline stage",
         "refused: error names the stage kind without measurements"),
    case(lambda t: t.__setitem__("p2p_s", 1e300), r"'p2p_s': 1e\+300: expected", "huge-p2p",
         "a 1e300 s p2p time", "refused: error names p2p_s and the value"),
    case(lambda t: t["attention"].__setitem__("block_size", 48),
         r"'attention.block_size': 48: expected a power of two", "block-48",
         "block size 48", "refused: error names attention.block_size and the value"),
    case(lambda t: t["measurements"][2].__setitem__("doc_lengths", [2 ** 40]),
         r"'measurements\[2\].doc_lengths': 1099511627776 tokens .* expected at most",
         "huge-doc", "a 2**40-token document", "refused before its work is built"),
]


@pytest.mark.parametrize("mutate,needle", DEGENERATE)
def test_degenerate_tables_are_refused_naming_file_field_and_value(tmp_path, table, mutate, needle):
    validate_table(table)                         # the fixture itself is sound
    mutate(table)
    p = write_table(tmp_path, json.dumps(table))       # NaN / Infinity written as JSON constants
    with pytest.raises(LatencyTableError, match=r"latency table .*t\.json: field " + needle):
        LatencyModel.load(p)


@rel("latency table", "all-zero coefficients passed in memory (no file)",
     "refused by LatencyModel itself: error names the coefficient")
def test_degenerate_coefficients_are_refused_without_a_file_too(table):
    coef = {k: {p: [0.0] * 5 for p in ("fwd", "bwd")} for k in ("first", "last")}
    with pytest.raises(LatencyTableError, match=r"<mem>: field 'coefficients.first.fwd'.*all zero"):
        LatencyModel(table, coef, where="<mem>")
    t = dict(table, coefficients=coef)
    with pytest.raises(LatencyTableError, match="all zero"):
        table_mod.write_table(t, "unused.json")   # never written


@rel("latency table", "a density-blind table (attention coefficient 0 everywhere)",
     "loaded with a warning that DST cannot trade density for time")
def test_density_blind_table_warns(tmp_path, table):
    for kind in table["coefficients"].values():
        for part in kind.values():
            part[2] = 0.0
    with pytest.warns(UserWarning, match="attention_work coefficient is 0.*DST cannot"):
        m = LatencyModel.load(write_table(tmp_path, table))
    assert m.predict([4096], 0.25, 0) == m.predict([4096], 1.0, 0)


@rel("latency table", "a 300 MB table file (sparse)",
     "refused before it is opened: error names the size and the 16 MiB limit")
def test_oversized_table_is_refused_before_it_is_read(tmp_path, monkeypatch):
    p = tmp_path / "big.json"
    with open(p, "wb") as fh:
        fh.truncate(300 * 10 ** 6)                # sparse: no disk used

    def no_open(*a, **k):
        raise AssertionError("the oversized table was opened")
    monkeypatch.setattr(table_mod, "open", no_open, raising=False)
    with pytest.raises(LatencyTableError) as e:
        read_table(str(p))
    msg = str(e.value)
    assert str(p) in msg and "300000000 bytes (286.1 MiB)" in msg
    assert f"{MAX_TABLE_BYTES} bytes (16 MiB) limit" in msg


@rel("latency table", "a table just under the size limit",
     "read (the limit refuses only larger files)")
def test_table_at_the_limit_is_read(tmp_path, table):
    text = json.dumps(table)
    p = write_table(tmp_path, text + " " * (MAX_TABLE_BYTES - len(text)))
    assert os.path.getsize(p) == MAX_TABLE_BYTES
    assert read_table(p)["source"] == "analytic"


@pytest.mark.parametrize("text,needle", [
    pytest.param("[" * 100000 + "]" * 100000, "nested too deeply|expected a JSON object",
                 id="deep", marks=rel("latency table", "JSON nested 100,000 deep",
                                      "refused: error names the file")),
    pytest.param('{"format": ' + "9" * 5000 + "}", "unreadable JSON value", id="digits",
                 marks=rel("latency table", "a 5,000-digit integer literal",
                           "refused: error names the file")),
    pytest.param(b"\xff\xfe{}", "not UTF-8", id="binary",
                 marks=rel("latency table", "a binary (non-UTF-8) file",
                           "refused: error names the file")),
])
def test_unreadable_json_is_refused_naming_the_file(tmp_path, text, needle):
    p = tmp_path / "odd.json"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(LatencyTableError, match=r"odd\.json.*(" + needle + ")"):
        read_table(str(p))


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
@rel("latency table", "--sb-latency-table /dev/zero (endless, size 0)",
     "refused as not a regular file, without reading")
def test_special_file_is_refused():
    with pytest.raises(LatencyTableError, match="/dev/zero: not a regular file"):
        read_table("/dev/zero")


EXEC_RUN = {"tensor_model_parallel_size": 1, "transformer_impl": "transformer_engine",
            "recompute_granularity": "none"}


@pytest.mark.parametrize("field,run_value", [
    pytest.param("tensor_model_parallel_size", 2, id="tp", marks=rel(
        "latency table", "a TP=1 table for a TP=2 run",
        "refused unless forced: error names execution.tensor_model_parallel_size, 1 vs 2")),
    pytest.param("transformer_impl", "local", id="impl", marks=rel(
        "latency table", "a transformer_engine table for a local-implementation run",
        "refused unless forced: error names execution.transformer_impl")),
    pytest.param("recompute_granularity", "full", id="recompute", marks=rel(
        "latency table", "a no-recompute table for a full-recompute run",
        "refused unless forced: error names execution.recompute_granularity")),
])
def test_table_from_another_execution_setup_is_refused_unless_forced(tmp_path, table, field,
                                                                     run_value):
    assert table["execution"] == EXEC_RUN
    p = write_table(tmp_path, table)
    LatencyModel.load(p, expect={"execution": EXEC_RUN})           # same setup: silent
    expect = {"execution": {**EXEC_RUN, field: run_value}}
    with pytest.raises(LatencyTableMismatch) as e:
        LatencyModel.load(p, expect=expect)
    msg = str(e.value)
    assert f"execution.{field}: table {EXEC_RUN[field]!r}, this run {run_value!r}" in msg
    assert "--sb-latency-table-force" in msg and p in msg
    other = [k for k in EXEC_RUN if k != field]
    assert not any(f"execution.{k}" in msg for k in other)
    with pytest.warns(UserWarning, match="used anyway"):
        assert LatencyModel.load(p, expect=expect, force=True).predict([4096], 0.5, 0) > 0


@rel("latency table", "a format 1 table (no TP / implementation / recompute recorded)",
     "refused unless forced: error names each missing field and says to re-profile")
def test_format_1_table_is_refused_with_re_profile_unless_forced(tmp_path, table):
    table["format_version"] = 1
    del table["execution"]
    table.pop("call_coefficients", None)        # format 3 only
    p = write_table(tmp_path, table)
    assert LatencyModel.load(p).pp == 2                            # readable; nothing checked
    with pytest.raises(LatencyTableMismatch) as e:
        LatencyModel.load(p, expect={"execution": EXEC_RUN})
    msg = str(e.value)
    for k in EXEC_RUN:
        assert f"execution.{k}: missing in the table (a format_version 1 table predates it: " \
               f"re-profile with sparsebalance-profile)" in msg
    with pytest.warns(UserWarning, match="used anyway"):
        LatencyModel.load(p, expect={"execution": EXEC_RUN}, force=True)


@pytest.mark.parametrize("mutate,needle", [
    case(lambda t: t.pop("execution"), r"'execution': None: expected an object", "no-exec",
         "a format 2 table without its execution section", "refused: error names 'execution'"),
    case(lambda t: t["execution"].pop("transformer_impl"),
         r"'execution.transformer_impl': missing", "no-impl",
         "a format 2 table without transformer_impl", "refused: error names the field"),
    case(lambda t: t["execution"].__setitem__("tensor_model_parallel_size", 0),
         r"'execution.tensor_model_parallel_size': 0: expected an integer >= 1", "tp0",
         "tensor_model_parallel_size 0", "refused: error names the field and the value"),
    case(lambda t: t["execution"].__setitem__("recompute_granularity", "most"),
         r"'execution.recompute_granularity': 'most': expected one of", "recompute-bogus",
         "recompute_granularity 'most'", "refused: error names the field and the value"),
])
def test_malformed_execution_section_is_refused(tmp_path, table, mutate, needle):
    mutate(table)
    with pytest.raises(LatencyTableError, match=r"t\.json: field " + needle):
        LatencyModel.load(write_table(tmp_path, table))


def test_analytic_table_models_recomputation():
    shape = ModelShape(num_layers=2, seq_length=4096)
    c = {g: analytic_table(shape, recompute_granularity=g)["coefficients"]["only"]
         for g in ("none", "selective", "full")}
    assert c["selective"]["fwd"] == c["none"]["fwd"] == c["full"]["fwd"]
    # selective: the core attention's forward again; full: every layer's (not the LM head's)
    assert c["selective"]["bwd"][2] == pytest.approx(c["none"]["bwd"][2] + c["none"]["fwd"][2])
    assert c["selective"]["bwd"][1] == c["none"]["bwd"][1]
    assert c["none"]["bwd"][1] < c["full"]["bwd"][1] < c["none"]["bwd"][1] + c["none"]["fwd"][1]
    assert c["full"]["bwd"][3] == c["none"]["bwd"][3]            # the selection is cached
    with pytest.raises(ValueError, match="recompute_granularity='most'"):
        analytic_table(shape, recompute_granularity="most")


# --- online calibration ----------------------------------------------------------------------

def _model(ema=0.3):
    return LatencyModel.analytic(ModelShape(num_layers=2, seq_length=4096), calibration_ema=ema)


@pytest.mark.parametrize("measured", [
    pytest.param(1e9, id="1e9s", marks=rel(
        "latency calibration", "one 1e9 s timing (predicted 1 s)",
        "the factor moves by at most 1 + w * 3 (1.9 at w = 0.3), not to 3e8")),
    pytest.param(1e-9, id="1e-9s", marks=rel(
        "latency calibration", "one 1e-9 s timing (predicted 1 s)",
        "the factor moves by at most 1 / 4 of the way down (0.775 at w = 0.3)")),
])
def test_one_outlier_timing_moves_the_factor_by_a_bounded_step(measured):
    m = _model()
    for _ in range(5):
        m.calibrate(0, 1.0, 1.0)
    assert m.correction(0) == pytest.approx(1.0)
    with pytest.warns(UserWarning, match=r"rank 0: measured / predicted = .* is more than 4x off"):
        m.calibrate(0, 1.0, measured)
    w = 0.3
    bound = (1 - w) + w * (CALIBRATION_CLIP if measured > 1 else 1 / CALIBRATION_CLIP)
    assert m.correction(0) == pytest.approx(bound)
    assert 0.7 < m.correction(0) < 2.0
    for _ in range(20):                            # back to normal timings: recovers
        m.calibrate(0, 1.0, 1.0)
    assert m.correction(0) == pytest.approx(1.0, rel=1e-2)


@rel("latency calibration", "a lasting 10x slowdown of one rank",
     "still followed: the factor exceeds 9 within 8 steps (clipping bounds a step, not the trend)")
def test_a_lasting_slowdown_is_still_followed():
    m = _model()
    factors = []
    for _ in range(8):
        m.calibrate(1, [0.5, 0.5], [5.0, 5.0])
        factors.append(m.correction(1))
    assert factors[0] == pytest.approx(1.9)            # the first step is clipped (ratio 10 > 4)
    assert factors[3] == pytest.approx(0.7 * factors[2] + 0.3 * 10)  # then within the clip
    assert factors[-1] > 9.0 and m.correction(0) == 1.0


@pytest.mark.parametrize("predicted,measured", [
    pytest.param(1.0, float("nan"), id="nan", marks=rel(
        "latency calibration", "a NaN timing", "ignored: the previous factor is kept")),
    pytest.param(1.0, None, id="none", marks=rel(
        "latency calibration", "a missing (None) timing", "ignored: the previous factor is kept")),
    pytest.param(1.0, -2.0, id="negative", marks=rel(
        "latency calibration", "a negative timing", "ignored: the previous factor is kept")),
    pytest.param(1.0, 0.0, id="zero", marks=rel(
        "latency calibration", "a zero timing", "ignored: the previous factor is kept")),
    pytest.param(1.0, float("inf"), id="inf", marks=rel(
        "latency calibration", "an infinite timing", "ignored: the previous factor is kept")),
    pytest.param([1.0, 1.0], [2.0, float("nan")], id="one-nan-element", marks=rel(
        "latency calibration", "one NaN among a rank's micro-batch timings",
        "ignored: the previous factor is kept")),
    pytest.param([1.0, 1.0], [2.0, None], id="one-none-element", marks=rel(
        "latency calibration", "one None among a rank's micro-batch timings",
        "ignored: the previous factor is kept")),
    pytest.param([1.0, 1.0], [2.0], id="length-mismatch", marks=rel(
        "latency calibration", "fewer timings than predictions",
        "ignored: the previous factor is kept")),
    pytest.param(1.0, "slow", id="text", marks=rel(
        "latency calibration", "a non-numeric timing ('slow')",
        "ignored: the previous factor is kept, no exception")),
    pytest.param(float("nan"), 1.0, id="nan-prediction", marks=rel(
        "latency calibration", "a NaN prediction", "ignored: the previous factor is kept")),
    pytest.param(0.0, 1.0, id="zero-prediction", marks=rel(
        "latency calibration", "a zero prediction", "ignored: the previous factor is kept")),
])
def test_unusable_samples_keep_the_previous_factor(predicted, measured):
    m = _model(ema=0.5)
    m.calibrate(2, 1.0, 2.0)
    assert m.correction(2) == pytest.approx(1.5)
    n_errors = len(m.calibration_state()["errors"])
    with pytest.warns(UserWarning, match="rank 2: unusable measurement.*keeping the previous "
                                         "correction 1.500"):
        m.calibrate(2, predicted, measured)
    assert m.correction(2) == pytest.approx(1.5)
    assert len(m.calibration_state()["errors"]) == n_errors      # no error sample either
    assert math.isfinite(m.predict([4096], 0.5, 0, rank=2))
    m.calibrate(2, 1.0, 1.5)                       # usable again: updates
    assert m.correction(2) == pytest.approx(1.5)
    m.calibrate(2, 1.0, 3.0)
    assert m.correction(2) == pytest.approx(2.25)


def test_calibration_state_roundtrip_keeps_clipping_relative_to_the_loaded_factor():
    m = _model()
    m.calibrate(0, 1.0, 3.0)
    again = _model()
    again.load_calibration_state(json.loads(json.dumps(m.calibration_state())))
    assert again.correction(0) == pytest.approx(m.correction(0))
    for x in (m, again):
        with pytest.warns(UserWarning):
            x.calibrate(0, 1.0, 1e6)
    assert again.correction(0) == pytest.approx(m.correction(0))
    assert np.isclose(m.correction(0), 0.7 * 1.6 + 0.3 * 4 * 1.6)
