"""The GPU acceptance check's logic on CPU (scripts/gpu_check.py): how it turns step results into
targets, its train step's comparisons and profiles, its provenance, and the device plan and its
carries (scripts/gpu_plan.py). The kernel table's own logic: test_kernel_table.py."""

import os
import sys
import types
from pathlib import Path

import pytest

from tests.conftest import REPO, load_script as _script


def test_targets_from_every_step():
    gc = _script("gpu_check")
    bench = {"summary": {"targets": {"32k_d0.25<=0.3x_cudnn": True,
                                     "32k_d0.5<=0.58x_cudnn": False}}}
    recompile = {"ok": True, "flex": {"recompiles_after_warmup": 2,
                                      "host_syncs_per_layer_path": 0},
                 "triton": {"recompiles_after_warmup": 0, "host_syncs_per_layer_path": 0}}
    train = {"runs": {"long_docs/sb_d0.5": {"speedup_vs_dense": 1.35},
                      "files/sb_d0.5": {"speedup_vs_dense": 1.05},
                      "files/sb_d0.25": {"speedup_vs_dense": 0.98}}}
    t = gc.targets({"bench": bench, "recompile": recompile, "train": train,
                    "latency": {"mape": 0.04}})
    assert t == {"32k_d0.25<=0.3x_cudnn": True, "32k_d0.5<=0.58x_cudnn": False,
                 "flex_no_recompiles_after_warmup": False, "flex_no_host_syncs_per_layer": True,
                 "triton_no_recompiles_after_warmup": True,
                 "triton_no_host_syncs_per_layer": True, "latency_mape<=5%": True,
                 "train_long_docs/sb_d0.5>=1.3x_dense": True,
                 "train_files/sb_d0.5>=1.1x_dense": False, "train_never_below_dense": False}
    assert gc.targets({}) == {}


def test_train_summary_skips_warmup_steps():
    gc = _script("gpu_check")
    recs = [dict(step=i + 1, loss=10 - i, tokens_per_s=1000.0 * (i + 1),
                 mean_density=0.5, density_per_stage=[0.5]) for i in range(gc.TRAIN_STEPS)]
    s = gc.train_summary(recs)
    steady = sorted(1000.0 * (i + 1) for i in range(gc.TRAIN_WARMUP, gc.TRAIN_STEPS))
    assert s["tokens_per_s"] == steady[len(steady) // 2] == s["median_step_tokens_per_s"]
    # with each step's tokens and seconds: all steady tokens over all steady seconds
    for i, r in enumerate(recs):
        r.update(tokens=100 * (i + 1), step_time_s=1.0 + (i % 2))
    s = gc.train_summary(recs)
    want = [(100 * (i + 1), 1.0 + (i % 2)) for i in range(gc.TRAIN_WARMUP, gc.TRAIN_STEPS)]
    assert s["tokens_per_s"] == sum(t for t, _ in want) / sum(x for _, x in want)
    assert s["step_s"] == {str(i + 1): 1.0 + (i % 2)
                           for i in range(gc.TRAIN_WARMUP, gc.TRAIN_STEPS)}
    assert s["losses"] == [10 - i for i in range(gc.TRAIN_STEPS)]
    assert s["mean_density"] == 0.5 and s["steps"] == gc.TRAIN_STEPS
    assert gc.train_summary([])["tokens_per_s"] is None


def test_autotune_step_says_when_its_script_is_missing(monkeypatch, tmp_path):
    gc = _script("gpu_check")
    monkeypatch.setattr(gc, "ROOT", str(tmp_path))
    got = gc.step_autotune("python3", str(tmp_path), 100, {})
    assert not got["ok"] and "autotune_triton.py" in got["missing"]


def test_every_call_names_its_device_commit_and_versions(tmp_path):
    """The e2e call runs no ``env`` step; its JSON still names the device and the versions."""
    gc = _script("gpu_check")
    doc = gc._write({"latency": {"ok": True}}, str(tmp_path))
    for key in ("commit", "torch", "triton", "cuda", "versions", "device"):
        assert key in doc, key
    gc._PROVENANCE["device"] = "NVIDIA H200"
    assert gc._write({"latency": {"ok": True}}, str(tmp_path))["device"] == "NVIDIA H200"
    got = gc._write({"env": {"ok": True, "device": "NVIDIA H100"}}, str(tmp_path))
    assert got["device"] == "NVIDIA H100"


def test_a_device_call_names_the_commit_it_ran(monkeypatch):
    """The machine's copy of the tree carries git metadata of the session's start: the plan's
    command names the local commit, and provenance takes it from there (dirty: unknown)."""
    gp = _script("gpu_plan")
    sys.path.insert(0, str(REPO / "scripts"))
    from studies import common
    head = gp.head_commit()
    assert head.split("+")[0] and all(f"SPARSEBALANCE_COMMIT={head};" in gp.command(c)
                                      for c in gp.PLAN)
    monkeypatch.setenv("SPARSEBALANCE_COMMIT", "abc123")
    p = common.provenance()
    assert p["commit"] == "abc123" and p["dirty"] is None
    monkeypatch.delenv("SPARSEBALANCE_COMMIT")
    assert common.provenance()["commit"] != "abc123"


def test_the_guide_states_each_steps_limit_as_the_script_has_it():
    import re
    gc = _script("gpu_check")
    text = (REPO / "docs/GPU.md").read_text()
    stated = {m.group(1): int(m.group(2))
              for m in re.finditer(r"^\| `(\w+)` \| .* \| (\d+) s \|$", text, re.M)}
    assert stated == gc.LIMIT_S


# --- the device plan and the carries (scripts/gpu_plan.py) ------------------------------------

def test_the_device_plan_fits_the_machine():
    gp = _script("gpu_plan")
    gc = _script("gpu_check")
    assert gp.plan_problems() == []
    assert [c.name for c in gp.PLAN] == ["kernel", "kernel-fa4", "e2e"]
    kernel, fa4, e2e = gp.PLAN
    assert kernel.steps == ("env", "bench")     # what imports, then the kernel table
    # the kernel call (issue 61): FA4's two pieces, no megatron-core, at most 7 minutes of
    # device time with the start (~40 s) and the transfers (~10 s a call)
    assert kernel.carry == (".whl-fa4/1",) and fa4.carry == (".whl-fa4/2",) and fa4.complete
    assert kernel.timeout_s + fa4.timeout_s + 40 + 20 <= 7 * 60
    assert "--bench-backends triton flex" in gp.command(kernel)
    assert "unpack --complete .whl-fa4/2 ||" in gp.command(fa4)
    assert "--bench-backends fa4 flash" in gp.command(fa4)
    # 15 minutes of device time: the start (~40 s) and a 30 s idle wait besides the calls
    assert sum(c.timeout_s for c in gp.PLAN) <= 15 * 60 - 90
    # the end-to-end runs measure the default backend ('auto': triton at variable lengths)
    assert "--train-backend" not in gp.command(e2e) and e2e.carry == (".whl",)
    # its latency table is a committed one (the latency step's time goes to the 64K runs)
    assert e2e.steps == ("train",) and (REPO / e2e.latency_table).is_file()
    assert f"--latency-table {e2e.latency_table} " in gp.command(e2e)
    for c in gp.PLAN:
        assert set(c.steps) <= set(gc.STEPS)
        # the call's steps, at their limits, end inside its budget
        assert sum(gc.LIMIT_S[s] for s in c.steps) <= c.budget_s, c.name
        cmd = gp.command(c)
        assert cmd.startswith(f"python3 scripts/gpu_plan.py unpack "
                              f"{'--complete ' if c.complete else ''}{' '.join(c.carry)} "
                              f"|| exit 3;")                     # its own wheels
        assert f"--budget-s {c.budget_s}" in cmd and f"$OUT/{c.name}" in cmd
    bad = [gp.Call("x", ("env",), 700, 650, carry=tuple("abcdefghi"))] * 3
    probs = gp.plan_problems(bad)
    assert any("add up to 2100 s: expected at most 810" in p for p in probs)
    assert any("timeout 700 s" in p for p in probs) and any("9 carried" in p for p in probs)


def test_the_quality_plan_fits_the_machine_and_keeps_the_kernel_calls():
    """Issue 62's GPU form: the kernel calls as in the kernels plan, each also staging a piece
    of the study's bundle, two calls that only stage, then the study; within the 810 s."""
    gp = _script("gpu_plan")
    plan = gp.PLANS["quality"]
    assert gp.plan_problems(plan) == []
    assert [c.name for c in plan] == ["kernel", "kernel-fa4", "stage-3", "stage-4", "quality"]
    for kernels_call, c in zip(gp.PLAN[:2], plan[:2]):
        # the same call, one more carried piece: --complete still names FA4's piece alone
        assert c.carry[:-1] == kernels_call.carry and c.carry[-1].startswith(gp.QUALITY + "/")
        assert gp.command(c).replace(f" {c.carry[-1]} ||", " ||") == gp.command(kernels_call)
    pieces = [p for c in plan for p in c.carry if p.startswith(gp.QUALITY + "/")]
    assert pieces == [f"{gp.QUALITY}/{i}" for i in range(1, 6)]
    assert len(gp.quality_rooms(20 * gp.MIB)) == len(pieces)     # pack-quality: one piece each
    study = plan[-1]
    cmd = gp.command(study)
    # the last piece must complete the bundle (a bare machine stops here, exit 3)
    assert cmd.startswith(f"python3 scripts/gpu_plan.py unpack --complete {gp.QUALITY}/5 .whl ")
    assert f"--bundle {gp.STAGE}/{gp.QUALITY}/files " in cmd
    assert f"--budget-s {study.budget_s} " in cmd and "$OUT/quality/trained_quality_gpu.json" in cmd
    assert study.budget_s + 90 <= study.timeout_s       # the evaluation after the last arm


def test_pieces_of_given_sizes_carry_a_folder_tree(tmp_path, monkeypatch):
    """``pack`` with the room of each call (the quality plan's bundle: sub-folders, no wheels):
    consecutive pieces of those sizes; each piece staged under its set's own folder; the last
    unpacks the tree; ``--complete`` binds only the folder after it."""
    import random
    gp = _script("gpu_plan")
    src = tmp_path / "bundle"
    (src / "weights").mkdir(parents=True)
    (src / "data").mkdir()
    rnd = random.Random(2)
    files = {"weights/weights.bin": rnd.randbytes(50000), "data/train.bin": rnd.randbytes(9000),
             "bundle.json": b"{}"}
    for name, data in files.items():
        (src / name).write_bytes(data)
    assert gp.main(["pack-quality", str(tmp_path / "nowhere")]) == 2      # one line, no work
    with pytest.raises(ValueError, match="expected a folder of files to pack"):
        gp.pack(str(tmp_path / "nowhere"), str(tmp_path / "x"), [1000])
    with pytest.raises(ValueError, match="more than the"):
        gp.pack(str(src), str(tmp_path / "small"), [10000, 10000])
    rooms = [8000, 30000, 30000, 30000]
    folders = gp.pack(str(src), str(tmp_path / ".set"), rooms)
    sizes = [sum(p.stat().st_size for p in Path(f).glob("piece.*")) for f in folders]
    # a piece for every call, each within its room and in proportion to it
    assert len(folders) == 4 and all(0 < s <= r for s, r in zip(sizes, rooms))
    assert abs(sizes[1] / sizes[0] - 30000 / 8000) < 0.01 and sizes[1] == sizes[2]
    monkeypatch.setattr(gp.subprocess, "run", lambda *a, **k: None)
    stage = tmp_path / "stage"
    said = gp.unpack(folders[:1], stage=str(stage))
    assert "staged; waiting" in said and (stage / ".set" / "piece.00").exists()
    gp.unpack(folders[1:3], stage=str(stage), complete=[])    # another set's --complete
    with pytest.raises(ValueError, match="the other pieces are not in"):
        gp.unpack(folders[3:], stage=str(tmp_path / "bare"), complete=[folders[3]])
    said = gp.unpack(folders[3:], stage=str(stage), complete=[folders[3]])
    out = stage / ".set" / "files"
    assert "unpacked into" in said
    assert {n: (out / n).read_bytes() for n in files} == files
    got = []
    monkeypatch.setattr(gp, "unpack", lambda folders, complete: got.append((folders, complete)))
    gp.main(["unpack", "--complete", "a/5", ".whl"])
    assert got == [(["a/5", ".whl"], ["a/5"])]


def test_carry_size_check():
    gp = _script("gpu_plan")
    mib = gp.MIB
    assert gp.carry_problem(7 * mib, {".whl": 10 * mib}) is None
    why = gp.carry_problem(int(6.7 * mib), {".whl-fa4/1": 58 * mib})   # issue 35's 64.7 MiB
    assert why and "64.7 MiB: expected at most 60 MiB" in why
    piece = gp.piece_bytes_for(7 * mib, 10 * mib)
    assert gp.carry_problem(7 * mib, {".whl": 10 * mib, "p": piece}) is None
    with pytest.raises(ValueError, match="leave"):
        gp.piece_bytes_for(50 * mib, 5 * mib)


@pytest.mark.reliability(area="device plan", case="a carried piece changed on the way",
                         expect="refused before anything is unpacked, naming the file")
def test_pieces_are_checksummed_before_they_are_unpacked(tmp_path):
    import random
    import zipfile
    gp = _script("gpu_plan")
    src = tmp_path / "wheels"
    src.mkdir()
    rnd = random.Random(0)               # incompressible: xz leaves its size as it is
    payload = {f"w{i}.bin": rnd.randbytes(15000 + 10000 * i) for i in range(3)}
    for name, data in payload.items():
        (src / name).write_bytes(data)
    members = {"pkg/__init__.py": b"x = 1\n" * 2000, "pkg-1.0.dist-info/RECORD": b"r"}
    with zipfile.ZipFile(src / "pkg-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    folders = gp.pack(str(src), str(tmp_path / "pieces"), 20000)
    assert len(folders) == 4                        # ~75 KB of xz in 4 equal pieces <= 20 KB
    sizes = [sum(p.stat().st_size for p in Path(f).glob("piece.*")) for f in folders]
    assert max(sizes) <= 20000 and max(sizes) - min(sizes) <= 4
    for f in folders:
        gp.verify(f)
    stage, out = tmp_path / "stage", tmp_path / "out"
    stage.mkdir()
    import shutil
    for i, f in enumerate(folders):
        shutil.copy(f"{f}/piece.{i:02d}", stage)
        shutil.copy(f"{f}/{gp.MANIFEST}", stage)
        assert gp.join_pieces(str(stage), str(out)) == (i == len(folders) - 1)
    # the files as they were; the wheel with the same members, now stored uncompressed
    assert {n: (out / n).read_bytes() for n in payload} == payload
    with zipfile.ZipFile(out / "pkg-1.0-py3-none-any.whl") as z:
        assert {i.filename: z.read(i) for i in z.infolist()} == members
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
    # a changed byte: the piece's own check names it; the joined tar's check too
    bad = Path(folders[1]) / "piece.01"
    bad.write_bytes(b"x" + bad.read_bytes()[1:])
    with pytest.raises(ValueError, match="piece.01: sha256"):
        gp.verify(folders[1])
    shutil.copy(bad, stage)
    with pytest.raises(ValueError, match="joined pieces' sha256"):
        gp.join_pieces(str(stage), str(tmp_path / "out2"))
    (tmp_path / "pieces" / "1" / "extra.whl").write_bytes(b"stray")
    with pytest.raises(ValueError, match="extra.whl not in SHA256SUMS"):
        gp.verify(str(tmp_path / "pieces" / "1"))


def test_paired_speedup_compares_the_same_steps():
    """Step k is the same global batch in every variant: the median of per-step ratios over the
    steps both runs timed."""
    gc = _script("gpu_check")
    base = {"step_s": {"4": 1.0, "5": 2.0, "6": 0.5, "7": 3.0}}
    run = {"step_s": {"4": 0.5, "5": 1.0, "6": 1.0, "8": 1.0}}
    assert gc.paired_speedup(base, run) == 2.0          # ratios 2, 2, 0.5 on steps 4-6
    assert gc.paired_speedup(base, {"step_s": {"9": 1.0}}) is None
    assert gc.paired_speedup({}, run) is None


def test_end_to_end_targets_count_against_the_faster_dense_baseline():
    """Issue 35: end to end is judged against dense attention with SAB packing where that run is
    faster than plain dense (the fairest dense baseline a user can have today)."""
    gc = _script("gpu_check")
    assert gc.TRAIN_VARIANTS["dense_sab"] == ["--sb-batching"]
    train = {"runs": {"long_docs/dense": {"tokens_per_s": 100.0},
                      "long_docs/dense_sab": {"tokens_per_s": 110.0, "speedup_vs_dense": 1.1},
                      "long_docs/sb_d0.5": {"tokens_per_s": 135.0, "speedup_vs_dense": 1.35,
                                            "speedup_vs_best_dense": 135.0 / 110.0}}}
    t = gc.targets({"train": train})
    assert t["train_long_docs/sb_d0.5>=1.3x_dense"] is False      # 1.23x the dense+SAB run
    assert t["train_never_below_dense"] is True


def test_the_train_step_runs_every_comparison_before_megatrons_fixed_micro_batch_dense():
    """Run 3 (H100) spent the train step's budget on the two fixed-micro-batch dense runs before
    the whole-file sparse runs could start; the comparisons the targets count come first."""
    gc = _script("gpu_check")
    order = gc.train_order({"long_docs": [], "files": []})
    assert sorted(order) == sorted((d, v) for d in ("long_docs", "files")
                                   for v in gc.TRAIN_VARIANTS if (d, v) not in gc.TRAIN_SKIP)
    assert ("files", "sb_d0.5") in order and ("files", "dense") in order
    first_dense = order.index(("long_docs", "dense"))
    assert {v for _, v in order[:first_dense]} == set(gc.TRAIN_VARIANTS) - {"dense"}
    assert order[first_dense:] == [("long_docs", "dense"), ("files", "dense")]
    assert {d for d, _ in order[:first_dense]} == {"long_docs", "files"}
    assert order[0] == ("long_docs", "dense_sab_sdpa")     # the target's data and baseline first
    assert gc.train_order({"files": []})[-1] == ("files", "dense")


def test_sparse_runs_count_against_the_fastest_dense_run_whichever_its_kernel():
    """Dense + SAB through cuDNN SDPA (``--sb-dense-kernel sdpa``) joins plain dense and dense +
    SAB through the varlen call: a sparse run is compared with the fastest, step for step too."""
    gc = _script("gpu_check")
    assert gc.TRAIN_VARIANTS["dense_sab_sdpa"] == ["--sb-batching", "--sb-dense-kernel", "sdpa"]
    steps = {"4": 1.0, "5": 1.0}
    runs = {"long_docs/dense": {"tokens_per_s": 50.0, "step_s": {"4": 4.0, "5": 4.0}},
            "long_docs/dense_sab": {"tokens_per_s": 80.0, "step_s": {"4": 1.25, "5": 1.25}},
            "long_docs/dense_sab_sdpa": {"tokens_per_s": 100.0, "step_s": steps},
            "long_docs/sb_d0.5": {"tokens_per_s": 110.0, "step_s": {"4": 0.8, "5": 0.8}},
            "files/dense_sab": {"tokens_per_s": 70.0},
            "files/sb_d0.5": {"tokens_per_s": 77.0}}
    gc.compare_with_dense(runs, "long_docs")
    gc.compare_with_dense(runs, "files")
    sb = runs["long_docs/sb_d0.5"]
    assert sb["best_dense"] == "dense_sab_sdpa"
    assert sb["speedup_vs_best_dense"] == pytest.approx(1.1)
    assert sb["paired_speedup_vs_best_dense"] == pytest.approx(1.25)
    assert sb["speedup_vs_dense"] == pytest.approx(2.2)
    assert "speedup_vs_best_dense" not in runs["long_docs/dense_sab_sdpa"]
    files = runs["files/sb_d0.5"]           # no plain dense run: the best is dense + SAB
    assert files["best_dense"] == "dense_sab" and "speedup_vs_dense" not in files
    assert files["speedup_vs_best_dense"] == pytest.approx(1.1)
    assert gc.targets({"train": {"runs": runs}})["train_long_docs/sb_d0.5>=1.3x_dense"] is False


@pytest.mark.parametrize("limit, ok", [(380, True), (340, False)])
def test_the_train_step_fails_for_a_comparison_cut_short_not_for_plain_dense(monkeypatch,
                                                                             tmp_path, limit,
                                                                             ok):
    """Every run takes 40 s of a fake clock: at 380 s the nine comparison runs (long documents
    in 32K and 64K micro-batches, cuDNN's measured at 32K, whole files) fit and the two
    plain-dense runs that come last are skipped (the step passes); at 340 s the whole-file d0
    0.5 run is skipped too (it fails)."""
    gc = _script("gpu_check")
    now = [0.0]
    ran = []

    def fake_run(cmd, log, left, env):
        ran.append(os.path.basename(log))
        now[0] += 40
        return 0, 40.0, ""

    monkeypatch.setattr(gc, "_run", fake_run)
    monkeypatch.setattr(gc, "_te_available", lambda env: False)
    monkeypatch.setattr(gc, "long_docs_prefix", lambda out: (str(tmp_path / "long"), 70))
    monkeypatch.setattr(gc, "time", types.SimpleNamespace(time=lambda: now[0]))  # its clock only
    res = gc.step_train(str(tmp_path), str(tmp_path / "none.json"), limit, {}, "auto")
    assert res["ok"] is ok
    assert ran[:4] == ["train_long_docs_dense_sab_sdpa.log", "train_long_docs_dense_sab.log",
                       "train_long_docs_sb_d0.5.log", "train_long_docs_sb_d0.25.log"]
    assert ran[4:7] == [f"train_long_docs_64k_{v}.log" for v in
                        ("dense_sab", "sb_d0.5", "sb_d0.25")]
    assert res["runs"]["long_docs/dense"] == {"ok": False, "skipped": "out of time"}
    assert ("train_files_sb_d0.5.log" in ran) is ok


def test_steps_that_paid_a_triton_compile_are_reported_and_left_out_beside():
    """A sparse run's records say which steps compiled a Triton kernel: the summary keeps its
    rates and adds the same without those steps (run 3's forward spikes of 0.3-0.5 s)."""
    gc = _script("gpu_check")
    recs = [dict(step=n, tokens=1000, step_time_s=t, tokens_per_s=1000 / t, kernel_compiles=c,
                 kernel_compile_s=0.5 * c) for n, t, c in
            ((1, 3.0, 9), (2, 1.0, 1), (3, 1.0, 0), (4, 1.5, 1), (5, 1.0, 0), (6, 1.0, 0))]
    out = gc.train_summary(recs)
    assert out["compile_steps"] == {"1": 4.5, "2": 0.5, "4": 0.5}
    assert out["step_s_no_compile"] == {"5": 1.0, "6": 1.0}
    assert out["tokens_per_s"] == pytest.approx(3000 / 3.5)
    assert out["tokens_per_s_no_compile"] == pytest.approx(1000.0)
    dense = gc.train_summary([dict(r, kernel_compiles=None) for r in recs])
    assert "compile_steps" in dense and dense["compile_steps"] == {}
    plain = gc.train_summary([{k: v for k, v in r.items() if not k.startswith("kernel")}
                              for r in recs])
    assert "compile_steps" not in plain             # a dense run records none
    runs = {"x/dense_sab": {"tokens_per_s": 800.0, "step_s": {"4": 1.25, "5": 1.25, "6": 1.25}},
            "x/sb_d0.5": out}
    gc.compare_with_dense(runs, "x")
    assert out["speedup_vs_best_dense_no_compile"] == pytest.approx(1.25)
    assert out["paired_speedup_vs_best_dense_no_compile"] == pytest.approx(1.25)
    assert out["paired_speedup_vs_best_dense"] == pytest.approx(1.25)   # median of 0.83, 1.25 x2


def test_unpack_installs_plain_wheels_beside_a_staged_piece(tmp_path, monkeypatch):
    """A call that carries .whl and the first FA4 piece installs .whl's wheels and stages the
    piece; the next, with the second piece, installs the joined set; --complete refuses a
    machine that came back bare."""
    import random
    gp = _script("gpu_plan")
    plain, src = tmp_path / "plain", tmp_path / "src"
    plain.mkdir()
    src.mkdir()
    (plain / "a-1-py3-none-any.whl").write_bytes(b"a")
    gp.write_manifest(str(plain))
    import zipfile
    with zipfile.ZipFile(src / "b-1-py3-none-any.whl", "w") as z:
        z.writestr("b/__init__.py", random.Random(1).randbytes(30000))
    first, second = gp.pack(str(src), str(tmp_path / "pieces"), 20000)
    installed = []
    monkeypatch.setattr(gp.subprocess, "run", lambda cmd, check: installed.append(
        sorted(os.path.basename(c) for c in cmd if c.endswith(".whl"))))
    stage = str(tmp_path / "stage")
    said = gp.unpack([str(plain), first], site=str(tmp_path / "site"), stage=stage)
    assert installed == [["a-1-py3-none-any.whl"]] and "staged; waiting" in said
    with pytest.raises(ValueError, match="the other pieces are not in"):
        gp.unpack([second], stage=str(tmp_path / "bare"), complete=True)
    gp.unpack([second], site=str(tmp_path / "site"), stage=stage, complete=True)
    assert installed[-1] == ["b-1-py3-none-any.whl"]


def test_dense_sab_is_re_priced_at_cudnns_kernel_and_each_sparse_run_compared():
    """Dense + SAB's steps less 8 layers x dense work x (varlen - cuDNN) per tile; a sparse run
    against it over all steady steps, without its compile steps, and step for step."""
    gc = _script("gpu_check")
    tiles = {"32768": {"cudnn": 0.5, "varlen": 0.75, "block": 128},
             "65536": {"cudnn": 0.25, "varlen": 1.25, "block": 128}}
    # 8 layers x 10,000 tiles x 0.25 us = 0.02 s off each 0.1 s dense step (32K micro-batches)
    runs = {"long_docs/dense_sab": {"step_s": {"4": 0.1, "5": 0.1},
                                    "step_tokens": {"4": 1000, "5": 1000},
                                    "step_dense_work": {"4": 10000, "5": 10000}},
            "long_docs/sb_d0.5": {"step_s": {"4": 0.05, "5": 0.1},
                                  "step_s_no_compile": {"4": 0.05},
                                  "step_tokens": {"4": 1000, "5": 1000}}}
    gc.cudnn_priced(runs, "long_docs", tiles)
    assert runs["long_docs/dense_sab"]["cudnn_priced_tokens_per_s"] == pytest.approx(2000 / 0.16)
    sb = runs["long_docs/sb_d0.5"]
    assert sb["vs_cudnn_priced"] == pytest.approx((2000 / 0.15) / (2000 / 0.16))
    assert sb["vs_cudnn_priced_no_compile"] == pytest.approx((1000 / 0.05) / (2000 / 0.16))
    assert sb["paired_vs_cudnn_priced"] == pytest.approx(0.08 / 0.05)   # the upper median
    assert gc.targets({"train": {"runs": runs}})["train_never_below_cudnn_priced_dense"] is True
    # 64K micro-batches take the 64K tile costs: 8 x 10,000 x 1.0 us = 0.08 s off
    runs64 = {f"long_docs_64k/{k[len('long_docs/'):]}": dict(v) for k, v in runs.items()}
    gc.cudnn_priced(runs64, "long_docs_64k", tiles)
    assert runs64["long_docs_64k/dense_sab"]["cudnn_priced_tokens_per_s"] == \
        pytest.approx(2000 / 0.04)
    assert gc.dense_tile_costs() == {} or torch_cuda()              # {} without CUDA


def test_the_measured_cudnn_run_is_the_baseline_and_the_re_priced_one_its_check():
    """With its calls at bounded padded lengths, dense + SAB through cuDNN is measured, not
    re-priced: each sparse run against it (all steps, without compile steps, step for step),
    its steps that ran slow against the varlen run of the same batch named (a cuDNN graph
    built), and its rate against the re-priced one beside it as the check."""
    gc = _script("gpu_check")
    assert ("long_docs", "dense_sab_sdpa") not in gc.TRAIN_SKIP
    steps = {"4": 0.1, "5": 0.1, "6": 0.1}
    tokens = {"4": 1000, "5": 1000, "6": 1000}
    runs = {"long_docs/dense_sab": {"tokens_per_s": 3000 / 0.3, "step_s": dict(steps),
                                    "step_tokens": tokens,
                                    "step_dense_work": {k: 10000 for k in steps}},
            # step 5 built a graph: 2x its varlen step where the others are 0.8x
            "long_docs/dense_sab_sdpa": {"tokens_per_s": 3000 / 0.36, "step_tokens": tokens,
                                         "step_s": {"4": 0.08, "5": 0.2, "6": 0.08}},
            "long_docs/sb_d0.5": {"tokens_per_s": 3000 / 0.24, "step_tokens": tokens,
                                  "step_s": {"4": 0.06, "5": 0.1, "6": 0.08},
                                  "tokens_per_s_no_compile": 2000 / 0.14}}
    gc.cudnn_measured(runs, "long_docs")
    cudnn, sb = runs["long_docs/dense_sab_sdpa"], runs["long_docs/sb_d0.5"]
    assert cudnn["cudnn_graph_steps"] == {"5": 0.2}
    assert cudnn["tokens_per_s_no_graph"] == pytest.approx(2000 / 0.16)
    assert sb["vs_cudnn_dense"] == pytest.approx(0.36 / 0.24)
    assert sb["vs_cudnn_dense_no_compile"] == pytest.approx((2000 / 0.14) / (3000 / 0.36))
    assert sb["paired_vs_cudnn_dense"] == pytest.approx(0.08 / 0.06)   # ratios 1.33, 2, 1
    tiles = {"32768": {"cudnn": 0.5, "varlen": 0.75, "block": 128}}
    gc.cudnn_priced(runs, "long_docs", tiles)       # 0.02 s off each varlen step
    assert cudnn["vs_cudnn_priced"] == pytest.approx((3000 / 0.36) / (3000 / 0.24))
    t = gc.targets({"train": {"runs": runs}})
    assert t["train_never_below_cudnn_dense"] is True
    assert t["train_never_below_cudnn_priced_dense"] is True
    runs["long_docs/sb_d0.5"]["tokens_per_s"] = 3000 / 0.4
    gc.cudnn_measured(runs, "long_docs")
    assert gc.targets({"train": {"runs": runs}})["train_never_below_cudnn_dense"] is False


def torch_cuda():
    import torch
    return torch.cuda.is_available()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_host_and_gpu_ms_tells_the_hosts_cost_from_the_kernels():
    """A call that only sleeps on the host shows its time in ``host_ms`` and none on the GPU; a
    call that reads a device value waits for the sleep kernel and is counted ``held``."""
    import time

    import torch
    sys.path.insert(0, str(REPO / "scripts"))
    from studies.common import host_and_gpu_ms
    x = torch.ones(1, device="cuda")
    host = host_and_gpu_ms(lambda: (time.sleep(0.004), x.add_(1)), reps=3)
    assert host["host_ms"] >= 4.0 and host["gpu_ms"] < 4.0 and host["held"] == 0
    synced = host_and_gpu_ms(lambda: x.add_(1).item(), reps=3, sleep_ms=10.0)
    assert synced["held"] == 3 and synced["host_ms"] >= 9.0


def test_a_profiled_steps_trace_says_how_busy_the_gpu_was(tmp_path):
    """``_gpu_trace.summarize_trace``: kernels summed, their union as the GPU's busy time
    (overlapping streams once) against the span from the first to the last, the recorded
    step's host time, the costliest kernels; a CPU trace has no kernel, a broken one says so."""
    import gzip
    import json
    sys.path.insert(0, str(REPO / "scripts"))
    from studies._gpu_trace import profile_flags, summarize_trace, trace_path
    events = [{"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#2", "ts": 0, "dur": 10_000},
              {"ph": "X", "cat": "kernel", "name": "flash_bwd", "ts": 1_000, "dur": 3_000},
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 2_000, "dur": 1_000},  # overlaps
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 6_000, "dur": 1_000},
              {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 8_000, "dur": 1_000},
              {"ph": "i", "cat": "kernel", "name": "marker", "ts": 9_500}]           # not a span
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = summarize_trace(str(path))
    assert got["kernels"] == 4 and got["host_step_ms"] == 10.0
    assert got["kernel_ms"] == 6.0 and got["gpu_busy_ms"] == 5.0 and got["gpu_span_ms"] == 8.0
    assert got["busy_fraction"] == 5.0 / 8.0
    assert got["top"][0] == {"name": "flash_bwd", "ms": 3.0, "count": 1}
    assert got["top"][1] == {"name": "gemm", "ms": 2.0, "count": 2}
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"traceEvents": events[:1]}))
    assert summarize_trace(str(cpu)) == {"kernels": 0, "host_step_ms": 10.0}
    assert "failed" in summarize_trace(str(tmp_path / "none.json.gz"))
    flags = profile_flags(str(tmp_path / "run"))
    assert flags[:2] == ["--profile", "--use-pytorch-profiler"]
    tb = flags[flags.index("--tensorboard-dir") + 1]       # Megatron writes beside it
    assert trace_path(str(tmp_path / "run")) == os.path.join(
        os.path.dirname(tb), "torch_profile", "rank-0.json.gz")


def test_the_train_step_profiles_the_32k_dense_and_sparse_runs(monkeypatch, tmp_path):
    """The two profiled runs get Megatron's profiler flags and their trace's summary; the
    others neither."""
    gc = _script("gpu_check")
    cmds = {}

    def fake_run(cmd, log, left, env):
        name = os.path.basename(log)[len("train_"):-len(".log")]
        cmds[name] = cmd
        if "--profile" in cmd:
            tb = cmd[cmd.index("--tensorboard-dir") + 1]
            out = os.path.join(os.path.dirname(tb), "torch_profile")
            os.makedirs(out)
            with open(os.path.join(out, "rank-0.json.gz"), "wb") as f:
                import gzip
                f.write(gzip.compress(b'{"traceEvents": []}'))
        return 0, 1.0, ""

    monkeypatch.setattr(gc, "_run", fake_run)
    monkeypatch.setattr(gc, "_te_available", lambda env: False)
    monkeypatch.setattr(gc, "long_docs_prefix", lambda out: (str(tmp_path / "long"), 70))
    res = gc.step_train(str(tmp_path), str(tmp_path / "none.json"), 1000, {}, "auto")
    profiled = {n for n, c in cmds.items() if "--profile" in c}
    assert profiled == {f"{d}_{v}" for d, v in gc.TRAIN_PROFILED} == \
        {"long_docs_dense_sab", "long_docs_sb_d0.25"}
    assert res["runs"]["long_docs/sb_d0.25"]["gpu_profile"] == {"kernels": 0,
                                                                "host_step_ms": None}
    assert "gpu_profile" not in res["runs"]["long_docs/sb_d0.5"]
    assert not any(p.startswith("profile_") for p in os.listdir(tmp_path))   # traces removed


def test_the_kernel_calls_time_two_lengths_for_the_simulators_price(monkeypatch, tmp_path):
    """Both kernel calls ask for single documents of 32K and 16K (``fit_price`` needs rows at
    two lengths: fa4's and triton's prices, the length-free kernels ``auto`` runs at variable
    lengths); gpu_check hands them to the kernel table, the smoke rows keep theirs."""
    gc, plan = _script("gpu_check"), _script("gpu_plan")
    for name in ("kernel", "kernel-fa4"):
        call = next(c for c in plan.PLAN if c.name == name)
        assert "--bench-lengths 32768 16384 " in plan.command(call)
    cmds = []
    monkeypatch.setattr(gc, "_run", lambda cmd, log, limit, env: (cmds.append(cmd), (0, 1, ""))[1])
    monkeypatch.setattr(gc, "rows_of", lambda path: [])
    gc.step_bench("py", str(tmp_path), str(tmp_path), 100, {}, ["fa4"], lengths=[32768, 16384])
    gc.step_bench("py", str(tmp_path), str(tmp_path), 100, {}, ["fa4"], smoke=True,
                  lengths=[32768, 16384])
    assert cmds[0][cmds[0].index("--lengths") + 1:][:2] == ["32768", "16384"]
    assert "--lengths" not in cmds[1]

