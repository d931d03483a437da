"""``make mcore020 MEGATRON_LM=<dir>``: the README's relative form works (pip would read a bare
``Megatron-LM`` as a package name, so the Makefile hands it an absolute path), and a path that
is not a directory is refused in one line before pip runs. pip itself is not run: ``PY=echo``
prints the command the recipe would run, ``-o`` keeps make from building the venv."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _make(cwd, *args):
    return subprocess.run(["make", "--no-print-directory", "-f", os.path.join(REPO, "Makefile"),
                           "-o", ".venv/.installed", "PY=echo", "mcore020", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("given", ["Megatron-LM", "./Megatron-LM", "{tmp}/Megatron-LM"])
def test_a_relative_megatron_lm_reaches_pip_as_a_path(tmp_path, given):
    (tmp_path / "Megatron-LM").mkdir()
    proc = _make(tmp_path, f"MEGATRON_LM={given.format(tmp=tmp_path)}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].split() == ["-m", "pip", "install", "-q", "--no-deps", "--target",
                                   ".mcore020", str(tmp_path / "Megatron-LM")], proc.stdout
    dry = subprocess.run(["make", "-n", "-f", os.path.join(REPO, "Makefile"), "-o",
                          ".venv/.installed", "mcore020", "MEGATRON_LM=Megatron-LM"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert f"--target .mcore020 {tmp_path}/Megatron-LM" in dry.stdout, dry.stdout


@pytest.mark.reliability(area="set-up", case="make mcore020 with MEGATRON_LM not a directory "
                         "(a typo), or not given",
                         expect="one line naming the value, exit 2, pip not run")
@pytest.mark.parametrize("given, needle", [
    ("MEGATRON_LM=Megatron-LN", "error: MEGATRON_LM=Megatron-LN: not a directory (expected a "
                                "clone of Megatron-LM main)"),
    ("MEGATRON_LM=", "usage: make mcore020 MEGATRON_LM=/path/to/Megatron-LM (main)"),
])
def test_a_megatron_lm_that_is_not_a_directory_is_refused(tmp_path, given, needle):
    proc = _make(tmp_path, given)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "pip install" not in proc.stdout
