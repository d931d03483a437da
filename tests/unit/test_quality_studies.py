"""The pure pieces of issue 73's quality studies, without a model: the inference study's plans
(the runtime's draft, a density per stage for every sample), its matched arm (uniform at DST's
kept density, within the tolerance), its shuffle, and both studies' refusal of a pilot's margin
fixed in another setting; the training study's documents (three needles, the answer's
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
from studies import _continued_report as cr  # noqa: E402
from studies import _inference_report as ir  # noqa: E402
from studies import continued_quality as cq  # noqa: E402
from studies import inference_quality as iq  # noqa: E402

SMOLLM2 = SimpleNamespace(num_layers=30, hidden_size=576, ffn_hidden_size=1536,
                          num_attention_heads=9, num_query_groups=3, kv_channels=64,
                          vocab_size=49152)


@pytest.fixture(scope="module")
def planned():
    args = iq.parse_args(["--pilot", "--samples", "40"])
    rng = random.Random(0)
    tokens = [rng.randint(2048, 4096) + 6 for _ in range(40)]
    return args, tokens, iq.plan(args, SMOLLM2, [t + 1 for t in tokens])


def test_every_sample_gets_its_micro_batch_densities_and_dst_moves(planned):
    args, tokens, p = planned
    assert p["stage_layers"] == [10, 10, 10]
    dens = p["stage_densities"]
    assert dens.shape == (40, 3) and np.isfinite(dens).all()
    assert ((dens > 0) & (dens <= 1)).all()
    assert sum(s["samples"] for s in p["steps"]) == 40
    assert sum(s["units_cut"] + s["units_raised"] for s in p["steps"]) > 0   # DST moved
    units = {tuple(u) for u in p["unit"]}
    for u in units:                 # the samples of one micro-batch share its densities
        rows = dens[[i for i, v in enumerate(p["unit"]) if tuple(v) == u]]
        assert (rows == rows[0]).all()


def test_matched_arm_keeps_dsts_density_and_the_shuffle_permutes(planned):
    args, tokens, p = planned
    d = iq.arm_densities(args, p, tokens, 30)
    kept = d["kept_planned"]
    assert abs(kept["matched"] - kept["dst"]) <= args.match_tolerance
    assert kept["control"] < kept["uniform"] < kept["dense"] == 1.0
    assert d["layers"]["uniform"][0] == [0.5] * 30
    assert sorted(map(tuple, d["layers"]["shuffled"])) == sorted(map(tuple, d["layers"]["dst"]))
    assert d["layers"]["dst"][0][:10] == [p["stage_densities"][0][0]] * 10


def test_a_margin_fixed_in_another_setting_is_refused(tmp_path):
    pilot = tmp_path / "pilot.json"
    args = iq.parse_args(["--pilot"])
    pilot.write_text(json.dumps({"config": vars(args), "margin": {"answer_nll": 0.01},
                                 "summary": {"n": 30, "pairs": {"control-uniform": {
                                     k: {"mean": 0.02} for k in iq.METRICS}}}}))
    fixed = ir.read_margin(iq.parse_args(["--margin-from", str(pilot)]))
    assert fixed["margin"] == {"answer_nll": 0.01} and fixed["margin_source"]["n"] == 30
    with pytest.raises(SystemExit, match="density"):
        ir.read_margin(iq.parse_args(["--margin-from", str(pilot), "--density", "0.25"]))
    # the GPU form (--prepare) may lengthen the samples, and says so; nothing else
    longer = ["--margin-from", str(pilot), "--lengths", "16384", "16384", "--seq-length", "16384"]
    with pytest.raises(SystemExit, match="lengths, seq_length"):
        ir.read_margin(iq.parse_args(longer))
    fixed = ir.read_margin(iq.parse_args(longer), ignore=("lengths", "seq_length"))
    assert fixed["margin_source"]["changed_since_pilot"] == {
        "lengths": [[2048, 4096], [16384, 16384]], "seq_length": [8192, 16384]}
    with pytest.raises(SystemExit, match="density"):
        ir.read_margin(iq.parse_args(longer + ["--density", "0.25"]), ignore=("lengths",
                                                                               "seq_length"))
    pilot.write_text(json.dumps({"config": dict(vars(args), pilot=False)}))
    with pytest.raises(SystemExit, match="not a pilot"):
        ir.read_margin(iq.parse_args(["--margin-from", str(pilot)]))
    cpilot = tmp_path / "cpilot.json"
    cargs = cq.parse_args(["--pilot", "--out", str(tmp_path)])
    cpilot.write_text(json.dumps({"config": vars(cargs), "margin": {"answer_nll": 0.01},
                                  "pairs": {"control-static": {k: {"mean": 0.02}
                                                               for k in cr.METRICS}}}))
    main = cq.parse_args(["--margin-from", str(cpilot), "--out", str(tmp_path)])
    assert cr.read_margin(main)["margin_source"]["seeds"] == [101, 102, 103]
    assert main.seeds == list(range(1, 11))
    with pytest.raises(SystemExit, match="steps"):
        cr.read_margin(cq.parse_args(["--margin-from", str(cpilot), "--out", str(tmp_path),
                                      "--steps", "10"]))


def test_pilot_or_margin_not_both_nor_neither():
    for argv in ([], ["--pilot", "--margin-from", "x.json"]):
        with pytest.raises(SystemExit):
            iq.parse_args(argv)


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
    """Synthetic per-sample scores: DST within 0.001 of matched, the control 0.02 worse than
    uniform on both metrics: non-inferior within a margin of 0.01, the control detected."""
    args = iq.parse_args(["--margin-from", "x.json"])
    rng = random.Random(5)
    samples = []
    for i in range(60):
        base = {"answer_nll": rng.uniform(0, 2), "loss": rng.uniform(2, 4), "exact": 1.0,
                "token_accuracy": 1.0, "kept": 0.6}
        noise = {k: rng.gauss(0, 0.002) for k in iq.METRICS}
        arms = {a: dict(base) for a in iq.ARMS}
        for k in iq.METRICS:
            arms["dst"][k] += noise[k]
            arms["control"][k] += 0.02 + rng.gauss(0, 0.005)
        samples.append({"tokens": 3000 + i, "arms": arms})
    out = ir.summarize({"samples": samples}, args, {"answer_nll": 0.01, "loss": 0.01})
    assert out["n"] == 60 and set(out["pairs"]) == {f"{a}-{b}" for a, b in iq.PAIRS}
    for k in iq.METRICS:
        v = out["verdicts"][k]
        assert v["verdict"] == "non-inferior" and v["control"]["detected"], v["reason"]
    assert ir.summarize({"samples": samples}, args)["verdicts"] == {}   # no margin, no verdict


def test_scoring_order_keeps_a_cut_run_about_matched(planned):
    """Scored in ``balanced_order``, every prefix of 20 or more samples keeps DST's kept density
    within 0.01 of the matched arm's, so a run cut short still compares like with like."""
    args, tokens, p = planned
    d = iq.arm_densities(args, p, tokens, 30)
    order = iq.balanced_order(tokens, d["layers"]["dst"], d["layers"]["matched"], args)
    assert sorted(order) == list(range(len(tokens)))
    for k in range(20, len(order) + 1):
        sub = order[:k]
        gap = iq.study_kept([tokens[i] for i in sub], [d["layers"]["dst"][i] for i in sub],
                            args) - iq.study_kept([tokens[i] for i in sub],
                                                  [d["layers"]["matched"][i] for i in sub], args)
        assert abs(gap) <= 0.01, (k, gap)
