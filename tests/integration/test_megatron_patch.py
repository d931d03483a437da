"""The Megatron-LM patch (patches/megatron_lm_pretrain_gpt.patch) and its apply script.

Always run: the patch is a well-formed unified diff whose hunks target the files it names and
call only hooks that exist; the script refuses a directory that is not a Megatron-LM checkout,
applies the patch to a checkout whose pretrain_gpt.py holds the patch's pre-image, detects it as
already applied, reverts it and refuses a file it does not fit. The hooks on Megatron's own
objects, and the patched flow on the installed megatron-core: test_megatron_hooks.py.
With ``MEGATRON_LM_DIR`` (core_r0.19.0), ``MEGATRON_LM_MAIN_DIR`` (main) and/or
``MEGATRON_LM_DEV_DIR`` (dev) set to real Megatron-LM checkouts: the branch's patch is applied to
a copy, the patched pretrain_gpt.py trains 3 steps with ``--sparse-balance`` (DST + SAB) on 2
ranks, CPU, the sparse kernel selects (kept density below 1), and its losses equal our entry's on
the same data.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATCH = REPO / "patches" / "megatron_lm_pretrain_gpt.patch"
SCRIPT = REPO / "scripts" / "apply_megatron_patch.sh"
TARGETS = {"pretrain_gpt.py", "gpt_builders.py", "model_provider.py"}
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")

pytestmark = pytest.mark.integration


def parse_patch(text: str) -> dict[str, list[dict]]:
    """{target path: [hunk]}; each hunk has old/new start, count and lines. Asserts well-formedness."""
    files: dict[str, list[dict]] = {}
    lines = text.splitlines()
    i, current = 0, None
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- "):
            assert lines[i + 1].startswith("+++ "), f"line {i + 2}: '---' without '+++'"
            old, new = line[4:].split("\t")[0], lines[i + 1][4:].split("\t")[0]
            assert old.startswith("a/") and new.startswith("b/") and old[2:] == new[2:], (old, new)
            current = new[2:]
            files.setdefault(current, [])
            i += 2
            continue
        m = HUNK.match(line)
        if m:
            assert current is not None, f"line {i + 1}: hunk before any file header"
            o0, oc, n0, nc = (int(g) if g is not None else 1 for g in m.groups())
            body, seen_o, seen_n = [], 0, 0
            i += 1
            while i < len(lines) and (seen_o < oc or seen_n < nc):
                b = lines[i]
                assert b[:1] in (" ", "-", "+") or b == "", f"line {i + 1}: bad hunk line {b!r}"
                kind = b[:1] or " "
                seen_o += kind in " -"
                seen_n += kind in " +"
                body.append(b)
                i += 1
            assert (seen_o, seen_n) == (oc, nc), f"hunk at {line!r}: counts {seen_o},{seen_n}"
            files[current].append(dict(old_start=o0, new_start=n0, lines=body))
            continue
        assert current is None or not line.startswith((" ", "+", "-")), (
            f"line {i + 1}: diff line outside a hunk: {line!r}")
        i += 1
    return files


def pre_image(hunks: list[dict]) -> str:
    """A file holding the patch's pre-image: every hunk's context and removed lines, in place."""
    out: list[str] = []
    for h in hunks:
        while len(out) < h["old_start"] - 1:
            out.append("# upstream line")
        out += [b[1:] for b in h["lines"] if b[:1] in (" ", "-", "")]
    return "\n".join(out) + "\n"


def run_script(*args, check_rc=None) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(SCRIPT), *map(str, args)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=60)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stdout
    return proc


def fake_checkout(root: Path, text: str) -> Path:
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "pretrain_gpt.py").write_text(text)
    return root


# --- the patch file ----------------------------------------------------------------------------

def test_patch_is_a_well_formed_diff_of_the_named_files():
    files = parse_patch(PATCH.read_text())
    assert files, "no file headers in the patch"
    assert set(files) <= TARGETS, f"patch touches {set(files) - TARGETS}"
    assert "pretrain_gpt.py" in files
    added = "\n".join(b for hs in files.values() for h in hs for b in h["lines"] if b[:1] == "+")
    # The wiring points: flags and defaults, install (spec, data, step hooks), data, forward
    # step, and the shutdown after pretrain() returns.
    for call in ("extra_args_provider(", "args_defaults(", "install(args, model_cfg)",
                 "datasets_provider(train_valid_test_datasets_provider)",
                 "forward_step(forward_step)", "sparsebalance_hooks.finish()"):
        assert call in added, f"patch does not add {call}"
    assert "from sparsebalance_megatron.megatron import hooks as sparsebalance_hooks" in added


def test_patch_calls_only_existing_hooks():
    from sparsebalance_megatron.megatron import hooks

    added = "\n".join(b[1:] for hs in parse_patch(PATCH.read_text()).values() for h in hs
                      for b in h["lines"] if b[:1] == "+")
    used = set(re.findall(r"sparsebalance_hooks\.(\w+)", added))
    assert used and all(callable(getattr(hooks, name, None)) for name in used), used


# --- the apply script --------------------------------------------------------------------------

def test_script_refuses_a_directory_that_is_not_a_checkout(tmp_path):
    out = run_script(tmp_path, check_rc=2).stdout
    assert "is not a Megatron-LM checkout" in out and "pretrain_gpt.py" in out
    out = run_script(tmp_path / "missing", check_rc=2).stdout
    assert "is not a directory" in out
    (tmp_path / "pretrain_gpt.py").write_text("print('hi')\n")
    out = run_script(tmp_path, check_rc=2).stdout
    assert "megatron/training/" in out
    assert (tmp_path / "pretrain_gpt.py").read_text() == "print('hi')\n"


def test_script_applies_detects_applied_and_reverts(tmp_path):
    original = pre_image(parse_patch(PATCH.read_text())["pretrain_gpt.py"])
    ckpt = fake_checkout(tmp_path / "Megatron-LM", original)
    target = ckpt / "pretrain_gpt.py"
    assert "applies cleanly" in run_script("--check", ckpt, check_rc=0).stdout
    assert "applied:" in run_script(ckpt, check_rc=0).stdout
    patched = target.read_text()
    assert "sparsebalance_hooks.install(args, model_cfg)" in patched
    out = run_script(ckpt, check_rc=0).stdout
    assert "already applied" in out
    assert target.read_text() == patched, "a second run changed the file"
    assert "reverted" in run_script("--revert", ckpt, check_rc=0).stdout
    assert target.read_text() == original


def test_script_refuses_a_file_the_patch_does_not_fit(tmp_path):
    original = pre_image(parse_patch(PATCH.read_text())["pretrain_gpt.py"])
    changed = original.replace("        forward_step,", "        my_forward_step,")
    assert changed != original
    ckpt = fake_checkout(tmp_path / "Megatron-LM", changed)
    out = run_script(ckpt, check_rc=1).stdout
    assert "does not apply" in out and "patches/README.md" in out
    assert (ckpt / "pretrain_gpt.py").read_text() == changed, "a failed apply touched the file"


# --- a real Megatron-LM checkout ---------------------------------------------------------------

def _tool_path(tmp_path: Path) -> str:
    """PATH on which ``python3`` / ``python3-config`` are this interpreter's: Megatron-LM builds
    its dataset helpers with ``make`` calling them (pybind11 comes with the [dev] extra)."""
    import sysconfig

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A wrapper, not a symlink: a symlinked interpreter would not find its virtualenv.
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    for cand in (Path(sys.base_prefix) / "bin" / f"python{ver}-config",
                 Path(sysconfig.get_config_var("BINDIR") or "") / f"python{ver}-config"):
        if cand.exists():
            (bin_dir / "python3-config").symlink_to(cand)
            break
    return os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])


# Real checkouts, by the variable naming each (fetch github:NVIDIA/Megatron-LM, then `git archive`
# or `git worktree add` of the branch); the patch each must take.
CHECKOUTS = {"core_r0.19.0": ("MEGATRON_LM_DIR", "megatron_lm_pretrain_gpt.patch"),
             "main": ("MEGATRON_LM_MAIN_DIR", "megatron_lm_pretrain_gpt.patch"),
             "dev": ("MEGATRON_LM_DEV_DIR", "megatron_lm_dev_pretrain_gpt.patch")}


def patched_copy(branch: str, tmp_path: Path, names) -> Path:
    """A copy of the checkout's entry scripts (``names``; its ``megatron`` linked), patched by the
    apply script with the branch's patch; skips the test when the checkout is not given."""
    env, patch = CHECKOUTS[branch]
    if not os.environ.get(env):
        pytest.skip(f"set {env} to a Megatron-LM {branch} checkout to run its patched scripts")
    src = Path(os.environ[env]).resolve()
    copy = tmp_path / "Megatron-LM"
    copy.mkdir()
    for name in names:
        if (src / name).exists():
            shutil.copy2(src / name, copy / name)
    (copy / "megatron").symlink_to(src / "megatron", target_is_directory=True)
    out = run_script(copy, check_rc=0).stdout
    assert f"applied: {copy}/pretrain_gpt.py ({patch})" in out, out
    assert "already applied" in run_script(copy, check_rc=0).stdout
    return copy


@pytest.mark.parametrize("branch", list(CHECKOUTS))
def test_patched_megatron_lm_trains_with_sparse_balance_like_our_entry(branch, tmp_path,
                                                                      small_jsonl):
    """The branch's patched pretrain_gpt.py trains 3 steps with --sparse-balance on 2 CPU ranks:
    the sparse kernel runs (every step's kept density, which only SparseCoreAttention's
    forward records after its selection, is below 1: not a dense model reporting planned
    densities; on main and core_r0.19.0 pretrain() builds the config container's model, on dev
    too once hooks.model_config gave it one), Megatron evaluates, and the losses equal our
    entry's."""
    from tests.conftest import ENTRY, TINY_MODEL, read_metrics, run_entry

    copy = patched_copy(branch, tmp_path, ("pretrain_gpt.py", "gpt_builders.py",
                                           "model_provider.py"))
    patched = (copy / "pretrain_gpt.py").read_text()
    compile(patched, str(copy / "pretrain_gpt.py"), "exec")
    imports = {(n.module, a.name) for n in ast.walk(ast.parse(patched))
               if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("sparsebalance_megatron.megatron", "hooks") in imports

    flags = [*TINY_MODEL, "--global-batch-size", "4", "--train-iters", "3", "--eval-iters", "1",
             "--data-path", str(small_jsonl), "--sparse-balance", "--sb-density", "0.5",
             "--sb-block-size", "32", "--sb-tokenizer", "byte",
             "--sb-data-cache-dir", str(tmp_path / "cache")]
    tools = _tool_path(tmp_path)
    runs = {}
    for name, script in (("megatron_lm", copy / "pretrain_gpt.py"), ("ours", ENTRY)):
        metrics = tmp_path / f"{name}.jsonl"
        proc = run_entry(2, [*flags, "--sb-metrics-file", metrics], cwd=tmp_path, timeout=600,
                         entry=script, env={"PATH": tools})
        assert "DST on" in proc.stdout and "packing sab" in proc.stdout
        assert "validation loss at iteration 3" in proc.stdout   # Megatron's eval ran
        runs[name] = read_metrics(metrics)
    a, b = runs["megatron_lm"], runs["ours"]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert 0 < x["kept_density"] < 1, x          # the sparse kernel ran, and selected
        assert x["tokens"] == y["tokens"] and x["mean_density"] == y["mean_density"]
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"]), (x["loss"], y["loss"])
