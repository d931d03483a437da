"""The device plan and its carries on CPU (scripts/gpu_plan.py): the calls fit the machine's
limits and its device time, each names its commit, the pieces are checksummed, staged and
joined."""

import os
import sys
import types
from pathlib import Path

import pytest

from tests.conftest import REPO, load_script as _script


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


def test_the_device_plan_fits_the_machine():
    """Issue 74: ONE plan for its open work, at most 13.5 minutes of device time with the start
    and the transfers (90 s of a session's 15 left to rerun a step); FA4's first piece staged
    alone (no room beside it for megatron-core), FA4's pieces and price next, then the
    full-depth steady steps, then DST with GPU timings in a call of its own (never measured
    yet; after e2e, whose runs leave FA4's compiled kernels on disk)."""
    gp = _script("gpu_plan")
    gc = _script("gpu_check")
    assert gp.plan_problems() == [] and gp.PLANS["issue74"] is gp.PLAN
    assert [c.name for c in gp.PLAN] == ["stage", "fa4", "e2e", "dst"]
    stage, fa4, e2e, dst = gp.PLAN
    assert gp.device_s(gp.PLAN) <= 13.5 * 60
    assert stage.carry == (".whl-fa4/1",) and fa4.carry == (".whl-fa4/2",) and fa4.complete
    assert fa4.steps == ("pieces", "bench")                # the decisive measurement first
    assert "--bench-backends fa4 --bench-lengths 32768 16384 " in gp.command(fa4)
    assert dst.steps == ("dst",) and e2e.steps == ("train",)
    assert dst.carry == e2e.carry == (".whl",)
    # every step gets at least its own limit's floor: the stage call's env step (limit 20 s) on
    # its budget of 25 s was skipped by a flat 30 s floor on 2026-11-30
    assert all(c.budget_s >= min(30, gc.LIMIT_S[s]) for c in gp.PLAN for s in c.steps[:1])
    # the end-to-end runs measure the default backend and plan with a table of their own model
    assert "--train-backend" not in gp.command(e2e) and "--latency-table" not in gp.command(e2e)
    for c in gp.PLAN + gp.KERNEL_CALLS:
        assert set(c.steps) <= set(gc.STEPS)
        # the call's steps, at their limits, end inside its budget
        assert sum(gc.LIMIT_S[s] for s in c.steps) <= c.budget_s, c.name
        cmd = gp.command(c)
        assert cmd.startswith(f"python3 scripts/gpu_plan.py unpack "
                              f"{'--complete ' if c.complete else ''}{' '.join(c.carry)} "
                              f"|| exit 3;")                     # its own wheels
        assert f"--budget-s {c.budget_s}" in cmd and f"$OUT/{c.name}" in cmd
    # the tree (21.9 MiB on 2026-11-27) with a 32.1 MiB FA4 piece fits, with .whl beside not
    assert gp.carry_problem(22 * gp.MIB, {".whl-fa4/1": int(32.1 * gp.MIB)}) is None
    assert gp.carry_problem(22 * gp.MIB, {".whl-fa4/1": int(32.1 * gp.MIB),
                                          ".whl": int(10.1 * gp.MIB)})
    bad = [gp.Call("x", ("env",), 700, 650, carry=tuple("abcdefghi"))] * 3
    probs = gp.plan_problems(bad)
    assert any("add up to 2100 s: expected at most 810" in p for p in probs)
    assert any("2170 s of device time: expected at most 900" in p for p in probs)
    assert any("timeout 700 s" in p for p in probs) and any("9 carried" in p for p in probs)
    assert gp.plan_problems(gp.PLAN[:2] + (dataclasses_replace(e2e, timeout_s=560), dst),
                            limit_s=810)


def dataclasses_replace(call, **kw):
    import dataclasses
    return dataclasses.replace(call, **kw)


def test_show_prints_the_plan_and_names_the_others(capsys):
    gp = _script("gpu_plan")
    assert gp.main(["show"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1. stage: ") and "810 s of device time" in out
    assert "other plans" in out and "kernels: issue 61" in out
    assert gp.main(["show", "kernels"]) == 0
    assert gp.main(["show", "nope"]) == 2


def test_pieces_carry_a_folder_tree(tmp_path, monkeypatch):
    """``pack`` of a folder tree (sub-folders, no wheels): each piece staged under its set's
    own folder; the last unpacks the tree; ``--complete`` binds only the folder after it."""
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
    with pytest.raises(ValueError, match="expected a folder of files to pack"):
        gp.pack(str(tmp_path / "nowhere"), str(tmp_path / "x"), 1000)
    folders = gp.pack(str(src), str(tmp_path / ".set"), 16000)
    assert len(folders) == 4
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


def test_the_kernel_calls_time_two_lengths_for_the_simulators_price(monkeypatch, tmp_path):
    """Every kernel call asks for single documents of 32K and 16K (``fit_price`` needs rows at
    two lengths for a per-token part: fa4's and triton's prices, the length-free kernels
    ``auto`` runs at variable lengths); gpu_check hands them to the kernel table."""
    gc, plan = _script("gpu_check"), _script("gpu_plan")
    import importlib
    ks = importlib.import_module("studies.device")
    for call in (c for c in plan.PLAN + plan.KERNEL_CALLS if "bench" in c.steps):
        assert "--bench-lengths 32768 16384 " in plan.command(call)
    cmds = []
    monkeypatch.setattr(ks, "_run", lambda cmd, log, limit, env: (cmds.append(cmd), (0, 1, ""))[1])
    monkeypatch.setattr(ks, "rows_of", lambda path: [])
    gc.step_bench("py", str(tmp_path), str(tmp_path), 100, {}, ["fa4"], lengths=[32768, 16384])
    gc.step_bench("py", str(tmp_path), str(tmp_path), 100, {}, ["fa4"])
    assert cmds[0][cmds[0].index("--lengths") + 1:][:2] == ["32768", "16384"]
    assert "--lengths" not in cmds[1]


def test_a_step_runs_on_its_own_limits_floor_and_not_below(monkeypatch, tmp_path):
    """A step starts with at least min(30 s, its limit) left: the stage call's env step (limit
    20 s) on its 25 s budget runs, dst (limit 150 s) on the same 25 s does not. A flat 30 s
    floor skipped the env step on the H200 on 2026-11-30. A fixed clock: no machine's load
    moves the time left."""
    gc = _script("gpu_check")
    ran = []
    monkeypatch.setattr(gc, "time", types.SimpleNamespace(time=lambda: 1000.0))
    monkeypatch.setattr(gc, "step_env", lambda out: ran.append("env") or {"ok": True})
    monkeypatch.setattr(gc, "step_dst", lambda *a: ran.append("dst") or {"ok": True})
    res = gc.run_steps(["env", "dst"], str(tmp_path), 1000.0 + 25)
    assert ran == ["env"] and res["env"]["ok"]
    assert res["dst"] == {"ok": False, "skipped": "out of time"}
