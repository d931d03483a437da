"""sparsebalance-layout as a user runs it: the console script on a profiled CPU table (pp=2, with
its middle stage), a length histogram, and a bad table named in one error line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(sys.executable).parent / "sparsebalance-layout"


def _run(args, cwd):
    return subprocess.run([str(SCRIPT), *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_layout_tool_on_a_profiled_table(tmp_path, tiny_latency_table_pp2):
    hist = tmp_path / "lengths.json"
    hist.write_text(json.dumps({"40": 30, "120": 12, "250": 4}))
    out = tmp_path / "layouts.json"
    proc = _run(["--latency-table", tiny_latency_table_pp2, "--pp", "2", "--dp", "2",
                 "--microbatches", "4", "--steps", "2", "--lengths", hist, "--json", out],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Best static configurations" in proc.stdout
    data = json.loads(out.read_text())
    described = {c["describe"] for c in data["static"]}
    assert {"1/3", "2/2", "3/1"} <= described      # every split of 4 layers over 2 stages
    assert data["seq_length"] == 256 and data["num_layers"] == 4
    # progress: every part of the search said on stderr as it runs, with its time; not on stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[sparsebalance-layout]")]
    said = [ln.split(": ", 1)[1] for ln in lines]
    assert said[0] == f"reading the document lengths of {hist}" and said[-1] == "done", lines
    for part in ("searching the static layouts, vp=1", "searching the sab layouts, vp=2"):
        assert part in said, (part, lines)
    for part in (r"simulating \d+ layouts x 3 static packings",
                 r"simulating \d+ layouts with SparseBalance \(SAB \+ DST\)"):
        assert any(re.fullmatch(part, s) for s in said), (part, lines)
    assert any(s.startswith("searched the dense layouts, vp=1: ") for s in said), lines
    seconds = [float(ln.split("]")[1].split(" s:")[0]) for ln in lines]
    assert seconds == sorted(seconds)
    assert "[sparsebalance-layout]" not in proc.stdout


def test_no_progress_prints_nothing(capsys):
    from sparsebalance_megatron.layout_cli import progress_printer

    progress_printer(False)("searching")
    progress_printer(True)("searching")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("[sparsebalance-layout]")
    assert err[0].endswith(" s: searching")


def test_a_table_that_cannot_predict_the_layouts_is_one_error_line(tmp_path,
                                                                   tiny_latency_table):
    proc = _run(["--latency-table", tiny_latency_table, "--pp", "2", "--steps", "1"], tmp_path)
    assert proc.returncode == 2
    assert "lacks stage kind(s) ['first', 'last']" in proc.stderr
    assert "Traceback" not in proc.stderr
