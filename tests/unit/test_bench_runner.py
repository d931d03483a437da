"""scripts/bench.py, the one benchmark runner: every named study exists and has ``main(argv)``,
every module of scripts/studies/ is a study or shared, the current pages start every study
through it, an unknown name is refused naming the studies, and every result JSON records its
command, commit, versions and device (studies/common.py)."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import bench  # noqa: E402
from studies import common  # noqa: E402

TOOLS = {"bench", "gpu_check", "gpu_plan", "convert_hf_to_megatron",
         "plot_timeline"}                     # scripts beside the runner; none is a study


def test_every_study_is_a_module_with_main_and_every_module_a_study_or_shared():
    for name in bench.STUDIES:
        path = SCRIPTS / "studies" / f"{name}.py"
        assert path.is_file(), f"study {name}: no {path.relative_to(REPO)}"
        tree = ast.parse(path.read_text())
        mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        assert mains and mains[0].args.args, f"study {name}: no main(argv)"
    modules = {p.stem for p in (SCRIPTS / "studies").glob("*.py")
               if not p.stem.startswith("_")} - set(bench.SHARED)
    assert modules <= set(bench.STUDIES), f"studies the runner does not name: {modules - set(bench.STUDIES)}"
    assert not set(bench.SHARED) & set(bench.STUDIES), "a module is a study or shared, not both"
    assert all((SCRIPTS / "studies" / f"{n}.py").is_file() for n in bench.SHARED), bench.SHARED
    scripts = {p.stem for p in SCRIPTS.glob("*.py")}     # a study is a module of studies/
    assert scripts <= TOOLS, f"scripts beside the runner that are not tools: {scripts - TOOLS}"


AT_COMMIT = re.compile(r"\bat\s+[0-9a-f]{7,40}\b")
# page -> why it still names studies that left the tree (being rewritten by another change)
PENDING: dict = {}


def runner_problems(page: Path) -> list:
    """What ``page`` names that the runner does not start: ``scripts/bench.py NAME`` of no
    study, a script of scripts/ that is not a tool, a module of scripts/studies/ not in the
    tree. A paragraph (or the one before it: a command block) that names the commit a command
    ran at ("at <commit>": git keeps it) may name what has left since. ``NAME``: a placeholder."""
    paras = re.split(r"\n\s*\n", page.read_text(encoding="utf-8"))
    out = []
    for i, para in enumerate(paras):
        if AT_COMMIT.search(para) or (i and AT_COMMIT.search(paras[i - 1])):
            continue
        for m in re.finditer(r"scripts/([\w/]+)\.py(?:\s+([a-z][a-z0-9_]*))?", para):
            path, name = m.groups()
            if path == "bench" and name and name not in bench.STUDIES or \
                    path.startswith("studies/") and not (SCRIPTS / f"{path}.py").is_file() or \
                    "/" not in path and path not in TOOLS:
                out.append(m.group(0))
    return out


def _pages():
    pages = [REPO / p for p in ("README.md", "BENCHMARKS.md", "QUALITY.md")]
    pages += sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "docs/benchmarks").glob("*.md"))
    for page in pages:
        why = PENDING.get(page.relative_to(REPO).as_posix())
        yield pytest.param(page, id=page.relative_to(REPO).as_posix(),
                           marks=[pytest.mark.xfail(reason=why, strict=False)] if why else [])


@pytest.mark.parametrize("page", list(_pages()))
def test_the_pages_start_every_study_through_the_runner(page):
    bad = runner_problems(page)
    assert not bad, f"{page.relative_to(REPO)} names what the runner does not start: {bad}"


def test_the_page_check_catches_a_script_beside_the_runner(tmp_path):
    page = tmp_path / "page.txt"       # (a name ending .md would read as a cited page)
    page.write_text("run `scripts/bench_x.py --a` and `scripts/bench.py gone --b`.\n\n"
                    "`scripts/bench.py sim_study`, `scripts/gpu_check.py`\n\n"
                    "then `scripts/old.py`, which ran at abc1234\n")
    assert runner_problems(page) == ["scripts/bench_x.py", "scripts/bench.py gone"]


@pytest.mark.reliability(area="benchmarks", case="unknown study name",
                         expect="exit 2 naming the studies")
def test_unknown_study_is_refused_with_the_list(capsys):
    assert bench.main(["no_such_study"]) == 2
    err = capsys.readouterr().err
    assert "no study 'no_such_study'" in err and "planner_cost" in err


def test_result_records_command_commit_versions_and_device(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "COMMAND", ["python", "scripts/bench.py", "x", "--json", "p"])
    path = tmp_path / "sub" / "r.json"
    common.write_result(str(path), {"rows": [1]})
    doc = json.loads(path.read_text())
    assert doc["rows"] == [1]
    assert doc["command"] == "python scripts/bench.py x --json p"
    assert doc["versions"]["python"] and "numpy" in doc["versions"]
    assert doc["device"].startswith("cpu") or doc["device"]
    assert doc["commit"] is None or len(doc["commit"]) == 40
    # a study's own device name is kept, the rest added
    doc = common.write_result(None, {"device": "H100 (measured)"})
    assert doc["device"] == "H100 (measured)" and "commit" in doc


def test_a_script_is_recorded_by_its_path_from_the_repository_root(monkeypatch):
    monkeypatch.setattr(common, "COMMAND", None)
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / "gpu_check.py"), "--out-dir", "o"])
    assert common.command() == "python scripts/gpu_check.py --out-dir o"
    monkeypatch.setattr(sys, "argv", ["/elsewhere/x.py", "-v"])
    assert common.command() == "python /elsewhere/x.py -v"


def test_median_ms_takes_the_median_of_the_timed_calls_after_the_warmup(monkeypatch):
    """The wall-clock path (no GPU), with a clock that advances by each call's index: the
    warm-up calls are not timed, and the median is of the rest."""
    calls, now = [], [0.0]

    def fn():
        calls.append(1)
        now[0] += len(calls) / 1e3         # call k takes k ms

    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    assert common.median_ms(fn, reps=3, warmup=2, cuda=False) == pytest.approx(4.0)
    assert len(calls) == 5
    with pytest.raises(ValueError, match="reps=0"):
        common.median_ms(fn, reps=0, cuda=False)


def test_runner_lists_and_runs_a_study_through_its_parser():
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench.py")], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and "planner_cost" in proc.stdout
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench.py"), "mask_memory", "--help"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0 and "python scripts/bench.py mask_memory" in proc.stdout


def test_dense_sab_run_pairs_the_same_steps_and_reports_every_seeds_sign():
    """The real-run study's arithmetic (no run here: the runs are minutes of torchrun): step k of
    one packing is divided by step k of SAB's on the same tokens, per seed and over all steps;
    runs that trained on different tokens are refused."""
    from studies.dense_sab_run import paired, summarize

    def run(times, tokens=(10, 11, 12), stood=0):
        return {"step_times_s": list(times), "tokens": list(tokens),
                "sab_stood_down_steps": stood}

    per_seed = {1: {"sequential": run([2.0, 2.0, 2.0]), "token_balanced": run([1.5, 1.5, 1.5]),
                    "sab": run([1.0, 2.0, 1.0], stood=1)},
                2: {"sequential": run([1.0, 1.0, 1.0]), "token_balanced": run([1.0, 1.0, 1.0]),
                    "sab": run([2.0, 2.0, 1.0])}}
    s = summarize(per_seed)
    assert s["seeds"][1]["sequential_over_sab_paired"] == [2.0, 1.0, 2.0]
    assert s["seeds"][1]["steps_sab_faster"] == 2 and s["seeds"][1]["sab_stood_down_steps"] == 1
    assert s["seed_signs"] == {1: "+", 2: "-"}
    assert s["sequential_over_sab_median"] == pytest.approx(1.0)   # median of 6 paired steps
    with pytest.raises(SystemExit, match="did not train on the same steps' tokens"):
        paired({"a": run([1.0] * 3), "b": run([1.0] * 3, tokens=(10, 11, 13))}, "a", "b")
