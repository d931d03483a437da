"""sparsebalance-profile measures the MLP the run has: a --no-swiglu table loads for a GeLU run
and is refused for a SwiGLU one; it records the execution setup (TP size, transformer
implementation, recomputation) the run checks, and refuses to profile TP > 1."""

from types import SimpleNamespace

import pytest

from sparsebalance_megatron.latency import LatencyModel, read_table
from sparsebalance_megatron.latency.table import FORMAT_VERSION, LatencyTableMismatch
from sparsebalance_megatron.latency.shape import ModelShape
from tests.conftest import REPO, run_python


def test_no_swiglu_profile_matches_a_gelu_run_only(tmp_path):
    args = SimpleNamespace(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                           num_attention_heads=4, num_query_groups=2, kv_channels=None,
                           padded_vocab_size=256, seq_length=128, micro_batch_size=1,
                           pipeline_model_parallel_size=1, swiglu=False)
    shape = ModelShape.from_megatron_args(args)
    out = tmp_path / "gelu.json"
    cmd = ["-m", "sparsebalance_megatron.megatron.profile_cli", "--quick",
           "--no-progress", "--out", str(out), *shape.cli_flags(), "--sb-block-size", "32",
           "--mixes", "2", "--densities", "0.5", "1.0", "--repeats", "1"]
    proc = run_python(cmd, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:]
    m = LatencyModel.load(str(out), expect={"model": shape.as_table_model()})
    assert m.table["model"]["swiglu"] is False and m.predict([128], 0.5, 0) > 0
    swiglu = ModelShape.from_megatron_args(SimpleNamespace(**{**vars(args), "swiglu": True}))
    with pytest.raises(LatencyTableMismatch, match="model.swiglu"):
        LatencyModel.load(str(out), expect={"model": swiglu.as_table_model()})


def _run_args(**kw):
    """Megatron's parsed args of a small run (the fields the latency setup reads)."""
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                num_query_groups=2, kv_channels=None, padded_vocab_size=256, seq_length=128,
                micro_batch_size=1, pipeline_model_parallel_size=1, swiglu=True,
                tensor_model_parallel_size=1, transformer_impl="local",
                recompute_granularity="full")
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.fixture(scope="module")
def recompute_table(tmp_path_factory):
    """A quick table of a full-recompute run, profiled with the flags the run would pass."""
    out = tmp_path_factory.mktemp("lat") / "full.json"
    shape = ModelShape.from_megatron_args(_run_args())
    cmd = ["-m", "sparsebalance_megatron.megatron.profile_cli", "--quick",
           "--no-progress", "--out", str(out), *shape.cli_flags(), "--sb-block-size", "32",
           "--mixes", "2", "--densities", "0.5", "1.0", "--repeats", "1"]
    proc = run_python(cmd, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return str(out)


def test_profiled_table_records_the_execution_setup(recompute_table):
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.launch.latency_setup import table_expectation

    table = read_table(recompute_table)
    assert table["format_version"] == FORMAT_VERSION == 3
    assert table["execution"] == {"tensor_model_parallel_size": 1, "transformer_impl": "local",
                                  "recompute_granularity": "full"}
    sb = SparseBalanceConfig(block_size=32)
    expect = table_expectation(_run_args(), sb)
    assert expect["execution"] == table["execution"]
    assert LatencyModel.load(recompute_table, expect=expect).predict([128], 0.5, 0) > 0


@pytest.mark.parametrize("kw,needle", [
    pytest.param({"tensor_model_parallel_size": 2},
                 "execution.tensor_model_parallel_size: table 1, this run 2", id="tp2",
                 marks=pytest.mark.reliability(
                     area="latency table", case="a profiled TP=1 table for a TP=2 run",
                     expect="refused unless --sb-latency-table-force: error names the TP size")),
    pytest.param({"recompute_granularity": None},
                 "execution.recompute_granularity: table 'full', this run 'none'",
                 id="no-recompute",
                 marks=pytest.mark.reliability(
                     area="latency table", case="a full-recompute table for a run without",
                     expect="refused unless forced: error names recompute_granularity")),
    pytest.param({"recompute_granularity": "selective"},
                 "execution.recompute_granularity: table 'full', this run 'selective'",
                 id="selective", marks=pytest.mark.reliability(
                     area="latency table", case="a full-recompute table for a selective run",
                     expect="refused unless forced: error names recompute_granularity")),
    pytest.param({"transformer_impl": "transformer_engine"},
                 "execution.transformer_impl: table 'local', this run 'transformer_engine'",
                 id="te", marks=pytest.mark.reliability(
                     area="latency table", case="a local-implementation table for a TE run",
                     expect="refused unless forced: error names transformer_impl")),
])
def test_run_with_another_execution_setup_refuses_the_table(recompute_table, kw, needle):
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.launch.latency_setup import table_expectation

    expect = table_expectation(_run_args(**kw), SparseBalanceConfig(block_size=32))
    with pytest.raises(LatencyTableMismatch) as e:
        LatencyModel.load(recompute_table, expect=expect)
    assert needle in str(e.value) and recompute_table in str(e.value)
    assert str(e.value).count("execution.") == 1          # only the field that differs
    with pytest.warns(UserWarning, match="used anyway"):
        LatencyModel.load(recompute_table, expect=expect, force=True)


def _tp_case(extra, case):
    return pytest.param(extra, id=case, marks=pytest.mark.reliability(
        area="latency profiler", case=f"sparsebalance-profile {case}",
        expect="refused before measuring: says a 1-process stage can neither measure nor "
               "model tensor-parallel time"))


@pytest.mark.parametrize("extra", [
    _tp_case([], "--tensor-model-parallel-size 2"),
    _tp_case(["--analytic"], "--analytic --tensor-model-parallel-size 2")])
def test_profiler_refuses_tensor_parallel(tmp_path, capsys, extra):
    from sparsebalance_megatron.megatron.profile_cli import main

    out = tmp_path / "tp2.json"
    with pytest.raises(SystemExit) as e:
        main(["--out", str(out), "--tensor-model-parallel-size", "2", *extra])
    assert e.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "--tensor-model-parallel-size 2" in err and "can neither measure nor model" in err
