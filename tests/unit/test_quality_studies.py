"""The pure pieces of the quality studies, without a model: the inference study's arms (the
runtime's draft at each layout, a density per stage for every sample; uniform at DST's predicted
step time; uniform at its kept density), its verdicts, and both studies' refusal of a pilot's
margin fixed in another setting; the training study's documents (three needles, the answer's
positions)."""

from __future__ import annotations

import json
import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from studies import continued_quality as cq  # noqa: E402
from studies import continued_verdicts as cv  # noqa: E402
from studies import inference_quality as iq  # noqa: E402

SMOLLM2 = SimpleNamespace(num_layers=30, hidden_size=576, ffn_hidden_size=1536,
                          num_attention_heads=9, num_query_groups=3, kv_channels=64,
                          vocab_size=49152)


@pytest.fixture(scope="module")
def planned():
    args = iq.parse_args(["--pilot", "--samples", "40"])
    rng = random.Random(0)
    tokens = [rng.randint(2048, 4096) + 6 for _ in range(40)]
    return args, tokens, iq.arms(args, SMOLLM2, tokens)


def test_every_sample_gets_its_micro_batch_densities_at_each_layout(planned):
    args, tokens, p = planned
    for lay, stages in (("pp3", 3), ("pp2", 2)):
        got = p["layouts"][lay]
        assert got["stage_layers"] == [30 // stages] * stages
        dens = np.asarray(got["stage_densities"])
        assert dens.shape == (40, stages) and ((dens > 0) & (dens <= 1)).all()
        assert sum(s["samples"] for s in got["steps"]) == 40
        units = {tuple(u) for u in got["unit"]}
        for u in units:                 # the samples of one micro-batch share its densities
            rows = dens[[i for i, v in enumerate(got["unit"]) if tuple(v) == u]]
            assert (rows == rows[0]).all()
        for i in range(40):            # one vector of sixths of the layers, the stages' own
            v = p["vectors"][f"dst@{lay}"][i]
            assert len(v) == iq.GROUPS and v[0] == pytest.approx(dens[i][0], abs=1e-6)
        for s in got["steps"]:          # no uniform density denser is predicted as fast
            assert s["equal_time_vs_static"] <= s["predicted_step_vs_static"] * (1 + 1e-9)
            assert s["equal_time_vs_static"] == pytest.approx(s["predicted_step_vs_static"],
                                                              rel=5e-3)
            if s["predicted_step_vs_static"] >= 1 - 1e-12:     # as slow as static: d0 or above
                assert s["equal_time_density"] >= args.density - 1e-9
    assert p["vectors"]["uniform"][0] == (0.5,) * iq.GROUPS
    assert p["vectors"]["control"][0] == (0.45,) * iq.GROUPS


def test_matched_arm_keeps_dsts_kept_density(planned):
    args, tokens, p = planned
    kept = p["kept_planned"]
    for lay in ("pp3", "pp2"):
        assert abs(kept[f"matched@{lay}"] - kept[f"dst@{lay}"]) <= 0.005
    assert kept["control"] < kept["uniform"]


def test_a_margin_fixed_in_another_setting_is_refused(tmp_path):
    pilot = tmp_path / "pilot.json"
    args = iq.parse_args(["--pilot"])
    pilot.write_text(json.dumps({"config": vars(args), "margin": {"answer_nll": 0.01},
                                 "summary": {"n": 16, "control": {
                                     k: {"mean": 0.02} for k in iq.METRICS}}}))
    fixed = iq.read_margin(iq.parse_args(["--margin-from", str(pilot)]))
    assert fixed["margin"] == {"answer_nll": 0.01} and fixed["margin_source"]["n"] == 16
    with pytest.raises(SystemExit, match="density"):
        iq.read_margin(iq.parse_args(["--margin-from", str(pilot), "--density", "0.25"]))
    with pytest.raises(SystemExit, match="lengths, seq_length"):
        iq.read_margin(iq.parse_args(["--margin-from", str(pilot), "--lengths", "16384",
                                      "16384", "--seq-length", "16384"]))
    pilot.write_text(json.dumps({"config": dict(vars(args), pilot=False)}))
    with pytest.raises(SystemExit, match="not a pilot"):
        iq.read_margin(iq.parse_args(["--margin-from", str(pilot)]))
    cpilot = tmp_path / "cpilot.json"
    cargs = cq.parse_args(["--pilot", "--out", str(tmp_path)])
    cpilot.write_text(json.dumps({"config": vars(cargs), "margin": {"answer_nll": 0.01},
                                  "pairs": {"control-static": {k: {"mean": 0.02}
                                                               for k in cv.METRICS}}}))
    main = cq.parse_args(["--margin-from", str(cpilot), "--out", str(tmp_path)])
    assert cq.read_margin(main)["margin_source"]["seeds"] == [101, 102, 103]
    assert main.seeds == list(range(1, 11))
    with pytest.raises(SystemExit, match="steps"):
        cq.read_margin(cq.parse_args(["--margin-from", str(cpilot), "--out", str(tmp_path),
                                      "--steps", "10"]))


def test_pilot_or_margin_not_both_nor_neither():
    for argv in ([], ["--pilot", "--margin-from", "x.json"]):
        with pytest.raises(SystemExit):
            iq.parse_args(argv)


def test_training_study_runs_n_stages_of_one_dp_rank_or_refuses_uneven_stages(capsys):
    args = cq.parse_args(["--pilot", "--out", "x", "--pipeline", "3", "--num-layers", "3"])
    cmd = cq.train_cmd(args, "static", 1, "d.jsonl", "t.json", "run")
    assert "--nproc_per_node=3" in cmd
    assert cmd[cmd.index("--pipeline-model-parallel-size") + 1] == "3"
    one = cq.train_cmd(cq.parse_args(["--pilot", "--out", "x"]), "static", 1, "d", "t", "r")
    assert "--nproc_per_node=2" in one and "--pipeline-model-parallel-size" not in one
    with pytest.raises(SystemExit):
        cq.parse_args(["--pilot", "--out", "x", "--pipeline", "3"])     # 2 layers
    assert "--pipeline 3: expected a positive divisor of --num-layers 2" in capsys.readouterr().err


def test_training_documents_hold_three_needles_and_their_answer_positions():
    rng = random.Random(1)
    text = "".join(f"line {i} of the haystack\n" for i in range(200))
    for length in (17, 40, 512, 700, 1023):          # 17: no haystack left, needles alone
        d = cq.make_document(rng, text, length, 3)
        doc, ans = d["text"], d["answer_positions"]
        assert len(doc) == length and ans == [length - 5, length - 3, length - 1]
        assert doc[length - 7] == cq.QUERY
        for marker, alphabet, p in zip(cq.MARKERS, cq.ALPHABETS, ans):
            assert doc[p - 1] == marker and doc.count(marker) == 2
            needle = doc.index(marker)             # the needle: the same key after its marker
            assert doc[needle + 1] == doc[p] and doc[needle + 2] == "\n"
            assert doc[p] in alphabet and sum(doc.count(c) for c in alphabet) == 2


def test_inference_summary_states_the_verdicts_with_the_fixed_margin():
    """Synthetic per-sample scores: DST 0.01 better than uniform on the loss, within 0.001 of
    the equal-time and matched arms, the control 0.02 worse than uniform on both metrics: DST
    better than uniform, non-inferior to both within a margin of 0.01, the control detected;
    the token-weighted loss weighs a sample by its tokens."""
    args = iq.parse_args(["--margin-from", "x.json", "--layouts", "pp3"])
    rng = random.Random(5)
    samples = []
    names = ("uniform", "control", "dst@pp3", "eqtime@pp3", "matched@pp3")
    for i in range(60):
        base = {"answer_nll": rng.uniform(0, 2), "loss": rng.uniform(2, 4), "exact": 1.0,
                "token_accuracy": 1.0, "kept": 0.6}
        arms = {a: dict(base) for a in names}
        for k in iq.METRICS:
            for a in ("dst@pp3", "eqtime@pp3", "matched@pp3"):
                arms[a][k] += -0.01 + rng.gauss(0, 0.0005)
            arms["control"][k] += 0.02 + rng.gauss(0, 0.005)
        samples.append({"index": i, "tokens": 3000 + 10 * i, "arms": arms})
    doc = {"samples": samples, "layouts": {"pp3": {
        "unit": [[0, 0, 0]] * 60, "steps": [{"predicted_step_vs_static": 0.99,
                                             "equal_time_vs_static": 0.99}]}}}
    out = iq.summarize(doc, args, {"answer_nll": 0.01, "loss": 0.01})
    assert out["n"] == 60 and all(c["detected"] for c in out["control"].values())
    v = out["verdicts"]
    assert v["pp3: dst - uniform (loss, token-weighted)"]["verdict"] == "better"
    for ref in ("eqtime", "matched"):
        got = v[f"pp3: dst - {ref} (answer_nll)"]
        assert got["verdict"] == "non-inferior", got["reason"]
    assert v["pp3: dst - eqtime (loss, token-weighted)"]["matched_on"] == "predicted step time"
    w = np.array([r["tokens"] for r in samples], dtype=float)
    d = np.array([r["arms"]["dst@pp3"]["loss"] - r["arms"]["uniform"]["loss"] for r in samples])
    got = out["comparisons"]["pp3: dst - uniform (loss, token-weighted)"]["mean"]
    assert got == pytest.approx(np.dot(w, d) / w.sum())
    assert "pp3: dst - eqtime (loss, token-weighted)" not in iq.summarize(
        doc, args, {})["verdicts"]                                # no margin, no such verdict


def test_the_matched_arm_is_matched_on_the_studys_work_weighted_kept_density():
    """DST keeps more of long samples and less of short ones; the matched arm one uniform
    density. Matched on the kept density weighted by attention work (as the arm is chosen),
    sample by sample they differ: the verdict is given; a matched arm 0.05 off is refused."""
    from sparsebalance_megatron.latency.work import attention_work

    args = iq.parse_args(["--margin-from", "x.json", "--layouts", "pp3"])
    tokens = [2048 + 256 * (i % 9) for i in range(40)]
    kept = [0.8 if t > 3000 else 0.4 for t in tokens]
    work = np.array([attention_work([t], 1.0, args.block_size) for t in tokens])
    study = float(np.dot(work, kept) / work.sum())

    def doc(matched_kept):
        rng = random.Random(3)
        samples = []
        for i, (t, k) in enumerate(zip(tokens, kept)):
            base = {"answer_nll": 1.0, "loss": 3.0, "exact": 0.0, "token_accuracy": 0.5}
            arms = {a: dict(base, kept=0.5) for a in ("uniform", "eqtime@pp3")}
            arms["dst@pp3"] = dict(base, kept=k)
            arms["matched@pp3"] = dict(base, kept=matched_kept)
            arms["control"] = dict(base, kept=0.45)
            for m in iq.METRICS:
                arms["control"][m] += 0.02 + rng.gauss(0, 0.005)
                arms["dst@pp3"][m] += rng.gauss(0, 0.0005)
            samples.append({"index": i, "tokens": t, "arms": arms})
        return {"samples": samples, "layouts": {"pp3": {
            "unit": [[0, 0, 0]] * len(tokens), "steps": [
                {"predicted_step_vs_static": 0.99, "equal_time_vs_static": 0.99}]}}}

    key = "pp3: dst - matched (loss, token-weighted)"
    got = iq.summarize(doc(study), args, {"answer_nll": 0.01, "loss": 0.01})
    assert got["arms"]["dst@pp3"]["kept_work_weighted"] == pytest.approx(study)
    assert got["verdicts"][key]["verdict"] == "non-inferior", got["verdicts"][key]["reason"]
    off = iq.summarize(doc(study + 0.05), args, {"answer_nll": 0.01, "loss": 0.01})
    assert off["verdicts"][key]["verdict"] == "not matched"


def test_continued_equal_time_verdict_reads_both_arms_at_d0_and_dsts_predicted_step():
    args = cq.parse_args(["--out", "x", "--pipeline", "3", "--num-layers", "3",
                          "--margin-from", "p.json"])
    seeds = ["1", "2", "3", "4"]

    def run(loss, ratio=None, extra=None):
        ev = {"0.5": {"answer_nll": 1.0, "heldout_loss": loss, "token_accuracy": 0.5,
                      "exact": 0.1}}
        ev.update(extra or {})
        return {"eval_density": 0.5 if extra is None else 0.61, "eval": ev,
                "train": {"doc_kept_density": 0.5, "predicted_step_vs_static": ratio}}
    # sparse_balance evaluated at its matched density (0.61: worse there) and at d0 (better)
    runs = {"static": {s: run(2.0 + 0.01 * i) for i, s in enumerate(seeds)},
            "control": {s: run(2.02 + 0.01 * i + 0.001 * (i % 2)) for i, s in enumerate(seeds)},
            "sparse_balance": {s: run(1.99 + 0.01 * i - 0.0005 * (i % 2), r, {"0.61": {
                "answer_nll": 1.0, "heldout_loss": 9.0, "token_accuracy": 0.5, "exact": 0.1}})
                for (i, s), r in zip(enumerate(seeds), (1.0, 0.998, 1.001, 1.0))}}
    got = cv.readings("verdicts_equal_time", seeds, runs, args, {"heldout_loss": 0.01})
    loss = got["heldout_loss"]
    assert loss["better"]["verdict"] == "better"
    assert loss["better"]["mean"] == pytest.approx(-0.01 - 0.00025)
    assert loss["non_inferior"]["verdict"] == "non-inferior"
    # DST 0.2% faster on seed 2 is matched (no slower), its gap kept as measured
    assert loss["non_inferior"]["density"]["gaps"] == pytest.approx([0, -0.002, 0.001, 0])
    assert loss["non_inferior"]["density"]["matched"]
    assert "non_inferior" not in got["answer_nll"]                  # no margin for it
    runs["sparse_balance"]["3"]["train"]["predicted_step_vs_static"] = 1.02   # 2% slower
    got = cv.readings("verdicts_equal_time", seeds, runs, args, {"heldout_loss": 0.01})
    assert got["heldout_loss"]["non_inferior"]["verdict"] == "not matched"


def test_the_refresh_arm_is_read_against_the_plain_dst_run_at_its_predicted_step(capsys):
    """refresh - sparse_balance, paired by seed, at d0 and each at its own trained profile, the
    step matched on the refreshed run's predicted step over the plain run's (not static's)."""
    args = cq.parse_args(["--out", "x", "--pipeline", "3", "--num-layers", "3",
                          "--margin-from", "p.json"])
    # one global batch's held-out micro-batches (8 at global batch 8, DP 1), several documents
    assert args.refresh_interval == 25 and cq.arm_flags(args, "refresh")[-4:] == [
        "--sb-quality-refresh-interval", "25", "--sb-quality-refresh-microbatches", "8"]
    assert cq.parse_args(["--out", "x", "--margin-from", "p.json"]).refresh_microbatches == 4
    assert cq.parse_args(["--out", "x", "--margin-from", "p.json", "--refresh-microbatches",
                          "3"]).refresh_microbatches == 3
    seeds = ["1", "2", "3", "4"]

    def run(loss, ratio=None, prof=None):
        ev = {"0.5": {"answer_nll": 1.0, "heldout_loss": loss, "token_accuracy": 0.5,
                      "exact": 0.1, "kept": 0.5}}
        out = {"eval_density": 0.5, "eval": ev, "train": {"predicted_step_vs_static": ratio}}
        if prof is not None:
            out["equal_work_profile"] = prof
            ev[cq.reading_key(prof)] = dict(ev["0.5"], heldout_loss=loss - 0.01)
        return out
    runs = {"static": {s: run(2.0 + 0.01 * i) for i, s in enumerate(seeds)},
            "control": {s: run(2.02 + 0.01 * i + 0.001 * (i % 2)) for i, s in enumerate(seeds)},
            "sparse_balance": {s: run(2.0 + 0.01 * i, 0.95, [0.6, 0.5, 0.4])
                               for i, s in enumerate(seeds)},
            "refresh": {s: run(1.998 + 0.01 * i - 0.0002 * (i % 2), r, [0.62, 0.5, 0.38])
                        for (i, s), r in zip(enumerate(seeds), (0.95, 0.949, 0.952, 0.95))}}
    got = cv.readings("verdicts_refresh", seeds, runs, args, {"heldout_loss": 0.01})
    for name in ("at_d0", "as_trained_at_d0_work"):
        loss = got[name]["heldout_loss"]
        assert loss["better"]["verdict"] == "better"
        assert loss["better"]["mean"] == pytest.approx(-0.002 - 0.0001)
        assert loss["non_inferior"]["verdict"] == "non-inferior"
        assert "over sparse_balance's" in loss["non_inferior"]["matched_on"]
        assert loss["predicted_step_vs_static"] == [0.95, 0.949, 0.952, 0.95]
    runs["refresh"]["3"]["train"]["predicted_step_vs_static"] = 0.97     # 2% slower than DST's
    got = cv.readings("verdicts_refresh", seeds, runs, args, {"heldout_loss": 0.01})
    assert got["at_d0"]["heldout_loss"]["non_inferior"]["verdict"] == "not matched"
    del runs["refresh"]["2"]["equal_work_profile"]
    assert set(cv.readings("verdicts_refresh", seeds, runs, args, {})) == {"at_d0"}
    with pytest.raises(SystemExit):
        cq.parse_args(["--out", "x", "--margin-from", "p.json", "--refresh-interval", "150"])
    assert "--refresh-interval 150: expected 1 <= N < --steps 150" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cq.parse_args(["--out", "x", "--margin-from", "p.json", "--refresh-microbatches", "0"])
    assert "--refresh-microbatches 0: expected a count of micro-batches >= 1" in \
        capsys.readouterr().err


def test_the_trained_profile_read_at_d0s_work_keeps_its_shape_and_d0s_blocks():
    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.latency.work import attention_work

    args = cq.parse_args(["--out", "x", "--pipeline", "3", "--num-layers", "6",
                          "--margin-from", "p.json"])
    summary = {"doc_planned_per_stage": [0.61234, 0.5, 0.44]}
    profile = cq.trained_profile(summary, args)
    assert profile == [0.6123, 0.6123, 0.5, 0.5, 0.44, 0.44]      # a stage's layers alike
    assert cq.reading_key(profile[:3]) == "layers 0.6123/0.6123/0.5000"
    assert cq.reading_key(0.5) == "0.5" and cq.reading_key(1.0) == "1"
    lengths = [600, 700, 1000, 1023]
    scaled = cq.equal_work(profile, lengths, args)
    sb = SparseBalanceConfig()

    def work(ds):
        return sum(attention_work(lengths, d, args.block_size, sb.sink_blocks, sb.local_blocks)
                   for d in ds)
    # d0's kept blocks, to within the one block a 4-decimal density can move
    assert abs(work(scaled) - work([args.density] * 6)) <= 6 * len(lengths)
    assert work(profile) > work([args.density] * 6) * 1.01        # the raw profile keeps more
    ratio = [a / b for a, b in zip(scaled, profile)]
    assert max(ratio) - min(ratio) < 1e-3 and ratio[0] < 1         # one factor, scaled down


def test_evaluate_scores_a_reading_once_for_the_same_documents(tmp_path, monkeypatch):
    args = cq.parse_args(["--out", "x", "--margin-from", "p.json"])
    budget = SimpleNamespace(default_density=None, layer_densities="unset")
    budget.set_layer_densities = lambda d: setattr(budget, "layer_densities", d)
    model = SimpleNamespace(decoder=SimpleNamespace(layers=[SimpleNamespace(
        self_attention=SimpleNamespace(core_attention=SimpleNamespace(budget=budget)))]))
    seen = []

    def score(_model, b, docs):
        seen.append((b.default_density, b.layer_densities))
        return [{"nll": 2.0, "tokens": 4, "answer_nll": 1.0, "exact": 0.0,
                 "token_accuracy": 0.5, "kept": 0.5} for _ in docs]
    monkeypatch.setattr(cq, "load_model", lambda *a: model)
    monkeypatch.setattr(cq, "score_docs", score)
    docs = [{"ids": [1, 2, 3, 4, 5], "answer_positions": [4]}]
    ckpt = str(tmp_path / "run" / "ckpt")
    (tmp_path / "run").mkdir()
    first = cq.evaluate(args, ckpt, docs, [0.5, [0.6, 0.4]])
    assert seen == [(0.5, None), (args.density, {1: 0.6, 2: 0.4})]
    assert set(first) == {"0.5", "layers 0.6000/0.4000"} and first["0.5"]["heldout_loss"] == 0.5
    again = cq.evaluate(args, ckpt, docs, [[0.6, 0.4], 1.0])
    assert seen[2:] == [(1.0, None)]                               # only the new reading
    assert again["layers 0.6000/0.4000"] == first["layers 0.6000/0.4000"]
    cq.evaluate(args, ckpt, [dict(docs[0], answer_positions=[3])], [0.5])
    assert seen[3:] == [(0.5, None)]                   # other documents: scored again


def test_the_as_trained_readings_compare_dsts_profile_and_dense_against_static():
    args = cq.parse_args(["--out", "x", "--pipeline", "3", "--num-layers", "3",
                          "--margin-from", "p.json"])
    seeds = ["1", "2", "3", "4"]
    prof = [0.55, 0.5, 0.45]

    def ev(loss, kept):
        return {"answer_nll": 1.0, "heldout_loss": loss, "token_accuracy": 0.5, "exact": 0.1,
                "kept": kept}

    def run(d, i, profile_loss=None):
        out = {"eval_density": d, "train": {"doc_kept_density": d},
               "eval": {f"{d:g}": ev(2.0 + 0.01 * i, d), "1": ev(1.9 + 0.01 * i, 1.0)}}
        if profile_loss is not None:
            out["eval"][cq.reading_key(prof)] = ev(profile_loss, 0.502)
            out["eval"]["1"] = ev(1.9 + 0.01 * i + 0.003 + 0.0002 * (i % 2), 1.0)
            out["equal_work_profile"] = prof
        return out
    runs = {"static": {s: run(0.5, i) for i, s in enumerate(seeds)},
            "control": {s: dict(run(0.45, i), eval={"0.45": ev(2.02 + 0.01 * i + 0.001 * (i % 2),
                                                                0.45)})
                        for i, s in enumerate(seeds)},
            "sparse_balance": {s: run(0.5, i, 1.995 + 0.01 * i - 0.0003 * (i % 2))
                               for i, s in enumerate(seeds)}}
    got = cv.readings("verdicts_as_trained", seeds, runs, args, {"heldout_loss": 0.01})
    prof_loss = got["trained_profile_at_d0_work"]["heldout_loss"]
    assert prof_loss["better"]["verdict"] == "better"
    assert prof_loss["better"]["mean"] == pytest.approx(-0.005 - 0.00015)
    assert prof_loss["non_inferior"]["verdict"] == "non-inferior"
    assert prof_loss["non_inferior"]["density"]["gaps"] == pytest.approx([0.002] * 4)
    dense = got["dense"]["heldout_loss"]
    assert dense["better"]["verdict"] == "worse"                    # +0.003 read dense
    assert dense["better"]["mean"] == pytest.approx(0.003 + 0.0001)
    assert "non_inferior" not in got["dense"]["answer_nll"]        # no margin for it
    assert "both_at_dsts_profile" not in got                       # static not read there
    for i, s in enumerate(seeds):      # static read at its seed's DST profile, as main records
        runs["static"][s]["equal_work_profile"] = prof
        runs["static"][s]["eval"][cq.reading_key(prof)] = ev(1.996 + 0.01 * i, 0.502)
    same = cv.readings("verdicts_as_trained", seeds, runs, args,
                       {"heldout_loss": 0.01})["both_at_dsts_profile"]
    assert same["heldout_loss"]["better"]["mean"] == pytest.approx(-0.001 - 0.00015)
    assert same["heldout_loss"]["non_inferior"]["density"]["gaps"] == pytest.approx([0] * 4)
    del runs["sparse_balance"]["2"]["equal_work_profile"]          # a run without the readings
    assert set(cv.readings("verdicts_as_trained", seeds, runs, args, {})) == {"dense"}


def test_a_confirmatory_inference_run_takes_fresh_seeds_or_refuses_negative_ones(capsys):
    assert iq.parse_args(["--margin-from", "x.json"]).seed_base == iq.MAIN_SEED_BASE
    assert iq.parse_args(["--pilot"]).seed_base == iq.PILOT_SEED_BASE
    assert iq.parse_args(["--margin-from", "x.json", "--seed-base", "600000"]).seed_base == 600000
    with pytest.raises(SystemExit):
        iq.parse_args(["--margin-from", "x.json", "--seed-base", "-1"])
    assert "--seed-base -1: expected an integer >= 0" in capsys.readouterr().err


def test_a_main_run_on_the_pilots_samples_is_refused_before_any_forward(tmp_path):
    pilot = tmp_path / "pilot.json"
    pargs = iq.parse_args(["--pilot"])                          # seeds 500000 .. 500015
    pilot.write_text(json.dumps({"config": vars(pargs), "margin": {"answer_nll": 0.01},
                                 "summary": {"n": 2, "control": {m: {"mean": 0.1}
                                                                  for m in iq.METRICS}}}))
    ok = iq.read_margin(iq.parse_args(["--margin-from", str(pilot), "--seed-base", "600000"]))
    assert ok["margin_source"]["seeds"] == [500000, 500016]
    with pytest.raises(SystemExit, match="--seed-base 499990 with --samples 60: the pilot .* "
                                         "scored seeds 500000-500015"):
        iq.read_margin(iq.parse_args(["--margin-from", str(pilot), "--seed-base", "499990"]))


def test_jobs_refuses_shard_and_no_processes_and_splits_the_cores(capsys, monkeypatch):
    from studies import plan_quality as pq

    for study, argv in ((iq, ["--pilot"]), (pq, ["--calibrate"])):
        with pytest.raises(SystemExit):
            study.parse_args([*argv, "--jobs", "2", "--shard", "1/2"])
        assert "--jobs 2 with --shard 1/2: expected one of them" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            study.parse_args([*argv, "--jobs", "0"])
        assert "--jobs 0: expected a count of processes >= 1" in capsys.readouterr().err
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    # plan_quality's 2 threads a process: 1 each for 2 processes of 2 cores, 1 for 3
    assert pq.parse_args(["--calibrate"]).threads == 2
    assert pq.parse_args(["--calibrate", "--jobs", "2"]).threads == 1
    assert pq.parse_args(["--calibrate", "--jobs", "3"]).threads == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(8)), raising=False)
    assert pq.parse_args(["--calibrate", "--jobs", "2"]).threads == 2     # --threads caps it
    assert pq.parse_args(["--calibrate", "--jobs", "2", "--threads", "8"]).threads == 4


def test_a_failed_shard_is_named_with_its_exit_code_after_every_child_is_waited_for():
    from studies import smollm2

    class Child:
        def __init__(self, rc):
            self.rc, self.waited = rc, False

        def wait(self):
            self.waited = True
            return self.rc

    children = [(1, Child(0)), (2, Child(137)), (3, Child(0))]
    with pytest.raises(SystemExit, match=r"^shard 2/4 exited with code 137 \(the cache keeps"):
        smollm2.wait_shards(children, 4)
    assert all(c.waited for _, c in children)
    smollm2.wait_shards([(1, Child(0))], 2)                 # all done: no stop


def test_eval_jobs_split_the_documents_and_gather_them_in_order(tmp_path, monkeypatch):
    """``--eval-jobs 3``: three contiguous shares of about equal tokens, each loading the
    checkpoint once and scoring every reading; the rows gathered in document order give the
    scores and means of one process (the pool here threads, the study's spawns processes)."""
    from concurrent.futures import ThreadPoolExecutor

    assert cq.share_bounds([10, 10, 10, 10, 10, 10], 3) == [0, 2, 4, 6]
    assert cq.share_bounds([100, 1, 1, 1, 100], 2) == [0, 3, 5]     # 102 and 101 tokens
    assert cq.share_bounds([5], 2) == [0, 1, 1]                     # a share may be empty
    args = cq.parse_args(["--out", "x", "--margin-from", "p.json", "--eval-jobs", "3"])
    loads = []

    def load(_args, _ckpt, sb):
        budget = SimpleNamespace(default_density=None, layer_densities=None)
        budget.set_layer_densities = lambda d: setattr(budget, "layer_densities", d)
        loads.append(budget)
        return SimpleNamespace(decoder=SimpleNamespace(layers=[SimpleNamespace(
            self_attention=SimpleNamespace(core_attention=SimpleNamespace(budget=budget)))]))

    def score(_model, b, docs):        # a row that depends on the document and the reading
        d = b.default_density + sum((b.layer_densities or {}).values())
        return [{"nll": len(x["ids"]) * d / 7, "tokens": len(x["ids"]) - 1,
                 "answer_nll": x["ids"][0] * d / 3, "exact": float(x["ids"][0] % 2),
                 "token_accuracy": x["ids"][0] % 3 / 2, "kept": d / 11} for x in docs]
    monkeypatch.setattr(cq, "load_model", load)
    monkeypatch.setattr(cq, "score_docs", score)
    rng = random.Random(1)
    docs = [{"ids": [i] * rng.randint(3, 40), "answer_positions": [2]} for i in range(13)]
    readings = [0.5, [0.6, 0.4], 1.0]
    (tmp_path / "one").mkdir()
    (tmp_path / "three").mkdir()
    one = cq.evaluate(args, str(tmp_path / "one" / "ckpt"), docs, readings)
    assert len(loads) == 1
    with ThreadPoolExecutor(2) as pool:
        three = cq.evaluate(args, str(tmp_path / "three" / "ckpt"), docs, readings, pool)
    assert len(loads) == 4                                  # once in each of the 3 shares
    assert json.dumps(three) == json.dumps(one)             # rows in order: the same floats
    assert [len(v["per_sample_answer_nll"]) for v in one.values()] == [13] * 3


def test_eval_jobs_below_one_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit):
        cq.parse_args(["--out", "x", "--pilot", "--eval-jobs", "0"])
    assert "--eval-jobs 0: expected a count of processes >= 1" in capsys.readouterr().err
    assert cq.parse_args(["--out", "x", "--pilot"]).eval_jobs == 1


def test_a_shard_makes_its_part_of_every_task_and_loads_the_model_once(tmp_path, monkeypatch):
    """``smollm2.measure`` of two tasks at ``--shard 1/2`` (a ``--jobs 2`` child of
    ``plan_quality --validate --refresh``): every second job of EACH task from the first, the
    model loaded once for both (the other shard's jobs left to it); then the summary's pass:
    every row, the shard's read from the caches."""
    from studies import smollm2

    loads, scored = [], []
    monkeypatch.setattr(smollm2, "load", lambda *a: loads.append(a) or (
        "model", "budget", None, SimpleNamespace(num_layers=2)))

    def score(model, budget, s, dens, stride):
        scored.append((s.seed, tuple(dens)))
        return {"loss": float(s.seed), "tokens": 3}
    monkeypatch.setattr(smollm2, "score", score)

    def sample(seed):
        return SimpleNamespace(task="t", length=8, depth=0.5, seed=seed, input_ids=[1, 2],
                               answer_ids=[3, 4])
    tasks = []
    for name, seeds in (("a", (0, 1, 2)), ("b", (10, 11))):
        samples = [sample(s) for s in seeds]
        jobs = [(i, (0.5, 0.5)) for i in range(len(samples))]
        tasks.append((jobs, samples, smollm2.Cache(str(tmp_path / f"{name}.jsonl"))))
    args = SimpleNamespace(jobs=1, shard=(1, 2), density=0.5, block_size=64, layers=None,
                           threads=1, loss_stride=1)
    got = smollm2.measure(args, *tasks)
    assert len(loads) == 1 and sorted(s for s, _ in scored) == [1, 11]
    assert [[r["loss"] for r in rows] for rows in got] == [[1.0], [11.0]]
    args.shard = (0, 1)                      # the summary: every row, the shard's from cache
    loads.clear(), scored.clear()
    got = smollm2.measure(args, *tasks)
    assert sorted(s for s, _ in scored) == [0, 2, 10] and len(loads) == 1
    assert [[r["loss"] for r in rows] for rows in got] == [[0.0, 1.0, 2.0], [10.0, 11.0]]


def test_validate_with_refresh_measures_both_in_one_pass_of_the_shards(tmp_path, monkeypatch):
    """``plan_quality --validate --refresh`` hands the plans' forwards and the refresh's to one
    ``measure``, so ``--jobs N`` starts its children once and they make their shards of both
    (the refresh's were the parent's alone); a child stops after it (no summary)."""
    from studies import plan_quality as pq
    from studies import smollm2

    monkeypatch.setattr(smollm2, "tokenizer", lambda: None)
    monkeypatch.setattr(smollm2, "encoder", lambda tok: None)
    monkeypatch.setattr(smollm2, "samples", lambda kinds, n, lengths, seed, enc: [
        SimpleNamespace(task="t", length=lengths[0], depth=0.5, seed=seed + i,
                        input_ids=[0] * (lengths[0] - 2), answer_ids=[0]) for i in range(n)])
    calls = []
    monkeypatch.setattr(pq, "measure", lambda args, *tasks: calls.append(tasks) or
                        [[] for _ in tasks])
    args = pq.parse_args(["--validate", "--quick", "--refresh", "--shard", "1/2",
                          "--cache", str(tmp_path / "v.jsonl")])
    args.refresh_cache = str(tmp_path / "r.jsonl")
    assert pq.validate(args) == 0
    (plans_task, refresh_task), = calls
    assert plans_task[2].path == args.cache and refresh_task[2].path == args.refresh_cache
    assert len(refresh_task[0]) == sum(len(mb) for mb in pq.held_out_bins(
        [smollm2.tokens(s) + 1 for s in refresh_task[1]], 4, pq.QUICK_SEQ)) * (pq.GROUPS + 1)
