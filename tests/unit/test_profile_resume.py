"""A latency profile cut short resumes (megatron/launch/profile.py with latency/partial.py): a profile that
fails after k samples keeps them; the retry measures only the rest and makes the table an
uninterrupted profile makes. The stage and its timer are stand-ins (deterministic times, no
process group), so what is asserted is the bookkeeping, not a clock."""

from __future__ import annotations

import pytest

from sparsebalance_megatron.config import SparseBalanceConfig
from sparsebalance_megatron.latency.partial import PartialProfile, read_progress
from sparsebalance_megatron.latency.shape import ModelShape
from sparsebalance_megatron.latency.table import validate_table

SHAPE = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, vocab_size=256, seq_length=256, pp=2)
SB = SparseBalanceConfig(block_size=32)
GRID = dict(densities=[0.25, 1.0], mixes=[[256], [64] * 4, [128, 128]], repeats=2, warmup=0)


class Killed(Exception):
    pass


class FakeStage:
    """build_stage / _budget_of / time_microbatch stand-ins: a time that follows from the
    sample's kind, documents and density; ``fail_after`` measured samples it raises."""

    def __init__(self, fail_after=None):
        self.measured, self.built, self.fail_after = [], [], fail_after

    def install(self, monkeypatch):
        from sparsebalance_megatron.megatron.launch import crossover, profile

        monkeypatch.setattr(profile, "init_single_process", lambda seed: None)
        monkeypatch.setattr(profile, "build_stage", self.build)
        monkeypatch.setattr(profile, "_budget_of", lambda model: self)
        monkeypatch.setattr(profile, "time_microbatch", self.time)
        monkeypatch.setattr(crossover, "crossover_of_shape", self.crossover)
        self.crossovers = 0

    def build(self, shape, sb, kind, num_layers):
        self.built.append(kind)
        return kind, "cpu"

    def set_routing(self, tokens):
        pass

    def crossover(self, shape, sb, repeats, warmup):
        self.crossovers += 1
        return {}

    def time(self, model, dev, kind, shape, docs, density, repeats, warmup, statistic="median"):
        if repeats == 0:
            return 0.0, 0.0                       # the stage's warm-up run
        if self.fail_after is not None and len(self.measured) == self.fail_after:
            raise Killed(f"killed after {self.fail_after} samples")
        self.measured.append((kind, tuple(docs), density))
        work = sum(d * d for d in docs) * density + 1e3 * len(docs)
        scale = {"first": 1.0, "middle": 0.8, "last": 1.3}[kind]
        return 1e-3 * scale * (1 + work / 1e4), 2e-3 * scale * (1 + work / 1e4)


def _profile(tmp_path, stage, monkeypatch, dense_crossover=True):
    from sparsebalance_megatron.megatron.launch.profile import profile_identity, profile_table

    stage.install(monkeypatch)
    ident = profile_identity(SHAPE, SB, statistic="median", dense_crossover=dense_crossover,
                             **GRID)
    partial = PartialProfile(str(tmp_path / "t.json.partial.jsonl"), ident, say=print)
    try:
        return profile_table(SHAPE, SB, statistic="median", dense_crossover=dense_crossover,
                             partial=partial, **GRID), partial
    finally:
        partial.close()


def _comparable(table):
    t = dict(table)
    t["profile"] = {k: v for k, v in t["profile"].items() if k != "created_utc"}
    return t


@pytest.mark.reliability(area="start-up profile", case="the profiler killed after 7 of its 36 "
                         "samples, then run again",
                         expect="the retry measures only the other 29 and writes the table an "
                         "uninterrupted profile writes")
def test_a_profile_cut_short_resumes_with_the_rest_only(tmp_path, monkeypatch):
    whole = FakeStage()
    reference, _ = _profile(tmp_path / "a", whole, monkeypatch)
    n = len(whole.measured)
    assert n == 3 * 3 * 2 * 2          # kinds (first, last, middle) x mixes x densities x repeats

    cut = FakeStage(fail_after=7)
    with pytest.raises(Killed):
        _profile(tmp_path / "b", cut, monkeypatch)
    assert read_progress(str(tmp_path / "b" / "t.json.partial.jsonl")) == (7, n)

    retry = FakeStage()
    table, partial = _profile(tmp_path / "b", retry, monkeypatch)
    assert partial.resumed == 7
    assert len(retry.measured) == n - 7
    assert cut.measured + retry.measured == whole.measured      # each sample once, in order
    assert retry.crossovers == 0 and cut.crossovers == 1        # the crossover is kept too
    validate_table(table)
    assert _comparable(table) == _comparable(reference)


@pytest.mark.reliability(area="start-up profile", case="the partial profile of a cut-short "
                         "profile edited: one sample's times negative, one sample a string",
                         expect="both samples measured again, the other 5 resumed; the table "
                         "equals an uninterrupted profile's (no numpy traceback, no table error)")
def test_bad_samples_in_a_partial_profile_are_measured_again(tmp_path, monkeypatch):
    import json

    reference, _ = _profile(tmp_path / "a", FakeStage(), monkeypatch)
    with pytest.raises(Killed):
        _profile(tmp_path / "b", FakeStage(fail_after=7), monkeypatch)
    path = tmp_path / "b" / "t.json.partial.jsonl"
    lines = path.read_text().splitlines()
    samples = [i for i, line in enumerate(lines) if json.loads(line).get("key", "").count("/") == 2]
    first, second = samples[1], samples[4]
    lines[first] = json.dumps({"key": json.loads(lines[first])["key"], "value": [-1e-3, 2e-3]})
    lines[second] = json.dumps({"key": json.loads(lines[second])["key"], "value": "1 ms"})
    path.write_text("\n".join(lines) + "\n")
    retry = FakeStage()
    table, partial = _profile(tmp_path / "b", retry, monkeypatch)
    assert partial.resumed == 5 and len(retry.measured) == 3 * 3 * 2 * 2 - 5
    validate_table(table)
    assert _comparable(table) == _comparable(reference)


def test_a_finished_stage_kind_is_not_built_again(tmp_path, monkeypatch):
    per_kind = 3 * 2 * 2
    cut = FakeStage(fail_after=per_kind + 1)       # the first kind done, one of the next
    with pytest.raises(Killed):
        _profile(tmp_path, cut, monkeypatch)
    retry = FakeStage()
    _profile(tmp_path, retry, monkeypatch)
    assert cut.built == ["first", "last"] and retry.built == ["last", "middle"]
    assert len(retry.measured) == 3 * per_kind - per_kind - 1


CLI = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
       "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "256",
       "--seq-length", "256", "--pipeline-model-parallel-size", "2", "--sb-block-size", "32",
       "--densities", "0.25", "1.0", "--mixes", "2", "--repeats", "1", "--no-progress",
       "--dense-crossover", "off"]


def _cli(tmp_path, stage, monkeypatch, *extra):
    from sparsebalance_megatron.megatron import profile_cli

    stage.install(monkeypatch)
    return profile_cli.main(CLI + ["--out", str(tmp_path / "t.json"), *extra])


@pytest.mark.parametrize("no_resume", [False, True])
def test_the_profiler_resumes_unless_told_not_to(tmp_path, monkeypatch, capsys, no_resume):
    with pytest.raises(Killed):
        _cli(tmp_path, FakeStage(fail_after=3), monkeypatch)
    partial = tmp_path / "t.json.partial.jsonl"
    assert partial.exists()
    capsys.readouterr()

    retry = FakeStage()
    assert _cli(tmp_path, retry, monkeypatch, *(["--no-resume"] if no_resume else [])) == 0
    err = capsys.readouterr().err
    whole = 3 * 2 * 2                      # kinds x mixes x densities, one repeat
    if no_resume:
        assert len(retry.measured) == whole
        assert f"[sparsebalance] ignoring the partial latency profile {partial} as asked " \
               "(--no-resume)" in err, err
    else:
        assert len(retry.measured) == whole - 3
        assert f"[sparsebalance] resuming the latency profile from {partial}: 3 samples" in err
    assert (tmp_path / "t.json").exists() and not partial.exists()


def test_the_profiler_shows_progress_on_stderr(tmp_path, monkeypatch, capsys):
    cli = [a for a in CLI if a != "--no-progress"]
    FakeStage().install(monkeypatch)
    from sparsebalance_megatron.megatron import profile_cli

    assert profile_cli.main(cli + ["--out", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr()
    assert "[sparsebalance] profiling 2 mixes x 2 densities x 1 repeats per stage kind" in out.err
    assert "12/12" in out.err                       # the bar: kinds x mixes x densities
    assert "12/12" not in out.out
