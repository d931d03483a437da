"""Latency table JSON: strict loading, clear errors naming file and field, compatibility check."""

import json

import numpy as np
import pytest

from sparsebalance_megatron.latency import LatencyModel, LatencyTableError, LatencyTableMismatch
from tests.unit.conftest import write_table


def test_save_load_roundtrip_is_json_and_predicts_the_same(tmp_path, table):
    m = LatencyModel.from_table(table)
    path = str(tmp_path / "lat.json")
    m.save(path)
    again = LatencyModel.load(path)
    assert json.load(open(path))["source"] == "analytic"
    for stage in (0, 1):
        assert again.predict([1000, 3096], 0.3, stage) == pytest.approx(
            m.predict([1000, 3096], 0.3, stage))


def test_truncated_and_malformed_json_name_the_file(tmp_path, table):
    text = json.dumps(table)
    p = write_table(tmp_path, text[: len(text) // 2])
    with pytest.raises(LatencyTableError, match="t.json.*not valid JSON"):
        LatencyModel.load(p)
    with pytest.raises(LatencyTableError, match="file not found"):
        LatencyModel.load(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("mutate,field", [
    (lambda t: t.pop("device"), "'device': missing"),
    (lambda t: t.pop("measurements"), "'measurements': missing"),
    (lambda t: t.__setitem__("measurements", []), "'measurements': empty grid"),
    (lambda t: t["measurements"][3].__setitem__("fwd_s", -1.0), r"measurements\[3\].fwd_s"),
    (lambda t: t["measurements"][0].__setitem__("bwd_s", float("nan")), r"measurements\[0\].bwd_s"),
    (lambda t: t["measurements"][2].pop("density"), r"measurements\[2\].density': missing"),
    (lambda t: t["measurements"][1].__setitem__("density", 1.5), r"measurements\[1\].density"),
    (lambda t: t["measurements"][1].__setitem__("doc_lengths", [0]), "doc_lengths"),
    (lambda t: t["attention"].pop("block_size"), "attention.block_size"),
    (lambda t: t["coefficients"]["first"].__setitem__("fwd", [1.0]), "coefficients.first.fwd"),
    (lambda t: t.__setitem__("format_version", 99), "format_version"),
    (lambda t: t.__setitem__("measurements", [m for m in t["measurements"] if m["kind"] == "first"]),
     r"stage kind\(s\) \['last'\]"),
])
def test_bad_fields_are_named(tmp_path, table, mutate, field):
    mutate(table)
    p = write_table(tmp_path, table)
    with pytest.raises(LatencyTableError, match="t.json.*" + field):
        LatencyModel.load(p)


def test_table_from_another_setup_is_refused_unless_forced(tmp_path, table):
    p = write_table(tmp_path, table)
    expect = {"device": "cpu: test", "torch": "2.13.0", "megatron_core": "0.19.2",
              "model": {"hidden_size": 896, "num_layers": 8}}
    with pytest.raises(LatencyTableMismatch) as e:
        LatencyModel.load(p, expect=expect)
    msg = str(e.value)
    assert "device" in msg and "torch version" in msg and "model.num_layers" in msg
    assert "model.hidden_size" not in msg and "--sb-latency-table-force" in msg
    with pytest.warns(UserWarning, match="used anyway"):
        m = LatencyModel.load(p, expect=expect, force=True)
    assert m.predict([4096], 0.5, 0) > 0
    same = {"device": table["device"], "model": {"num_layers": 4}}
    LatencyModel.load(p, expect=same)   # matching expectations load silently


def test_table_from_another_plugin_version_is_refused(tmp_path, table):
    table["software"]["sparsebalance_megatron"] = "0.1.0"
    p = write_table(tmp_path, table)
    with pytest.raises(LatencyTableMismatch, match="sparsebalance_megatron version"):
        LatencyModel.load(p, expect={"sparsebalance_megatron": "0.3.0"})
    LatencyModel.load(p, expect={"sparsebalance_megatron": "0.1.0+local"})
    del table["software"]["sparsebalance_megatron"]     # a table that does not say: not checked
    LatencyModel.load(write_table(tmp_path, table), expect={"sparsebalance_megatron": "0.3.0"})


def test_table_without_coefficients_is_fitted(tmp_path, table):
    ref = LatencyModel.from_table(table)
    del table["coefficients"]
    m = LatencyModel.load(write_table(tmp_path, table))
    # every unit of the grid makes one sparse call: its cost folds into const
    np.testing.assert_allclose(m.coef["last"]["bwd"][1:], ref.coef["last"]["bwd"][1:], rtol=1e-6,
                               atol=1e-15)
    assert "call_coefficients" not in m.table
    mixes = [[4096], [512] * 8, [100, 3000, 900]]
    for s in range(2):
        np.testing.assert_allclose(m.predict_many(mixes, 0.3, s), ref.predict_many(mixes, 0.3, s),
                                   rtol=1e-9)


def test_profile_cli_analytic_writes_a_loadable_qwen_table(tmp_path, capsys):
    from sparsebalance_megatron.megatron.profile_cli import main

    out = str(tmp_path / "qwen.json")
    assert main(["--analytic", "--num-layers", "24", "--hidden-size", "896",
                 "--ffn-hidden-size", "4864", "--num-attention-heads", "14",
                 "--num-query-groups", "2", "--vocab-size", "151936", "--seq-length", "32768",
                 "--pipeline-model-parallel-size", "4", "--out", out]) == 0
    assert "ANALYTIC" in capsys.readouterr().out
    m = LatencyModel.load(out, expect={"model": {"hidden_size": 896, "num_layers": 24}})
    assert m.table["source"] == "analytic" and m.pp == 4
    # the last stage carries the LM head + loss, the first the embedding: both cost more than
    # a middle stage with the same layers; attention work makes a long document dearer
    t = [m.predict([32768], 0.5, s) for s in range(4)]
    assert t[3] > t[0] > t[1] == pytest.approx(t[2])
    assert m.predict([32768], 0.5, 1) > m.predict([512] * 64, 0.5, 1)
