"""patches/megatron_lm_pretrain_hybrid.patch: Megatron-LM's pretrain_hybrid.py (HybridModel).

Always run: the patch is a well-formed diff of pretrain_hybrid.py alone, adding the six hook calls
(each exists in ``hooks``); the apply script patches both scripts of a checkout, detects them as
applied, reverts them, changes nothing when one of them does not fit, and skips a checkout
without pretrain_hybrid.py. With ``MEGATRON_LM_DIR`` (a core_r0.19.0 checkout),
``MEGATRON_LM_MAIN_DIR`` (main) and/or ``MEGATRON_LM_DEV_DIR`` (dev, which takes its own patch):
the patched pretrain_hybrid.py of that checkout trains
a ``*-|-*`` HybridModel with ``--sparse-balance`` (DST + SAB) at PP=2 x DP=2 on 4 CPU ranks,
evaluates, checkpoints and resumes like the uninterrupted run, and every step's loss equals our
entry's (examples/pretrain_hybrid_sparsebalance.py) on the same data.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.integration.test_megatron_patch import (_tool_path, parse_patch, pre_image,
                                                   run_script)

REPO = Path(__file__).resolve().parents[2]
PATCH = REPO / "patches" / "megatron_lm_pretrain_hybrid.patch"
GPT_PATCH = REPO / "patches" / "megatron_lm_pretrain_gpt.patch"

pytestmark = pytest.mark.integration


def test_patch_is_a_diff_of_pretrain_hybrid_adding_the_six_calls():
    from sparsebalance_megatron.megatron import hooks

    files = parse_patch(PATCH.read_text())
    assert set(files) == {"pretrain_hybrid.py"}
    added = "\n".join(b[1:] for h in files["pretrain_hybrid.py"] for b in h["lines"]
                      if b[:1] == "+")
    for call in ("extra_args_provider(", "args_defaults(", "install(args, model_cfg)",
                 "datasets_provider(train_valid_test_datasets_provider)",
                 "forward_step(forward_step)", "sparsebalance_hooks.finish()"):
        assert call in added, f"patch does not add {call}"
    used = set(re.findall(r"sparsebalance_hooks\.(\w+)", added))
    assert used and all(callable(getattr(hooks, name, None)) for name in used), used


def _checkout(root: Path, hybrid_text=None) -> Path:
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "pretrain_gpt.py").write_text(pre_image(parse_patch(GPT_PATCH.read_text())
                                                    ["pretrain_gpt.py"]))
    if hybrid_text is not None:
        (root / "pretrain_hybrid.py").write_text(hybrid_text)
    return root


def test_script_patches_both_scripts_and_reverts_them(tmp_path):
    original = pre_image(parse_patch(PATCH.read_text())["pretrain_hybrid.py"])
    ckpt = _checkout(tmp_path / "Megatron-LM", original)
    out = run_script("--check", ckpt, check_rc=0).stdout
    assert out.count("applies cleanly") == 2 and "pretrain_hybrid.py" in out
    run_script(ckpt, check_rc=0)
    patched = (ckpt / "pretrain_hybrid.py").read_text()
    assert "sparsebalance_hooks.install(args, model_cfg)" in patched
    assert "sparsebalance_hooks.install(args, model_cfg)" in (ckpt / "pretrain_gpt.py").read_text()
    assert run_script(ckpt, check_rc=0).stdout.count("already applied") == 2
    assert run_script("--revert", ckpt, check_rc=0).stdout.count("reverted") == 2
    assert (ckpt / "pretrain_hybrid.py").read_text() == original


def test_script_changes_nothing_when_one_script_does_not_fit(tmp_path):
    original = pre_image(parse_patch(PATCH.read_text())["pretrain_hybrid.py"])
    changed = original.replace("        forward_step,", "        my_forward_step,")
    assert changed != original
    ckpt = _checkout(tmp_path / "Megatron-LM", changed)
    gpt_before = (ckpt / "pretrain_gpt.py").read_text()
    out = run_script(ckpt, check_rc=1).stdout
    assert "does not apply" in out and "pretrain_hybrid.py" in out and "Nothing was changed" in out
    assert (ckpt / "pretrain_hybrid.py").read_text() == changed
    assert (ckpt / "pretrain_gpt.py").read_text() == gpt_before, "the GPT script was patched"


def test_script_skips_a_checkout_without_pretrain_hybrid(tmp_path):
    ckpt = _checkout(tmp_path / "Megatron-LM")
    out = run_script(ckpt, check_rc=0).stdout
    assert "skipped:" in out and "pretrain_hybrid.py does not exist" in out
    assert "applied: " in out   # the GPT script still is


# --- real Megatron-LM checkouts ------------------------------------------------------------------

CHECKOUTS = {"core_r0.19.0": ("MEGATRON_LM_DIR", "megatron_lm_pretrain_hybrid.patch"),
             "main": ("MEGATRON_LM_MAIN_DIR", "megatron_lm_pretrain_hybrid.patch"),
             "dev": ("MEGATRON_LM_DEV_DIR", "megatron_lm_dev_pretrain_hybrid.patch")}


def _flags(tmp_path: Path, data: Path, table) -> list[str]:
    """PP=2 x DP=2 (4 ranks), 4 steps, a checkpoint at step 2, evaluation at steps 2 and 4; one
    rank modelled twice as slow, so that DST moves units."""
    from tests.conftest import TINY_MODEL

    return [*TINY_MODEL, "--hybrid-layer-pattern", "*-|-*", "--pipeline-model-parallel-size", "2",
            "--global-batch-size", "4", "--train-iters", "4", "--eval-interval", "2",
            "--eval-iters", "1", "--data-path", str(data), "--sparse-balance",
            "--sb-density", "0.5", "--sb-block-size", "32", "--sb-tokenizer", "byte",
            "--sb-data-cache-dir", str(tmp_path / "cache"), "--sb-latency-table", str(table),
            "--sb-latency-table-force", "--sb-timing-source", "model",
            "--sb-straggler-rank", "1", "--sb-straggler-slowdown", "2"]


def _train(script: Path, flags: list, tmp_path: Path, name: str) -> list[dict]:
    from tests.conftest import read_metrics, run_entry

    metrics = tmp_path / f"{name}.jsonl"
    tools = tmp_path / f"tools_{name}"          # one PATH folder per run of this tmp_path
    tools.mkdir()
    proc = run_entry(4, [*flags, "--sb-metrics-file", metrics], cwd=tmp_path, timeout=900,
                     entry=script, env={"PATH": _tool_path(tools)})
    assert "attention layers of HybridModel '*-|-*'" in proc.stdout, proc.stdout[-3000:]
    assert "DST on" in proc.stdout and "packing sab" in proc.stdout
    assert "validation loss at iteration" in proc.stdout   # Megatron's eval ran
    return read_metrics(metrics)


def _train_and_resume(script: Path, tmp_path: Path, data: Path, table, name: str):
    """(the uninterrupted run's records, the records of a run resumed from its step-2
    checkpoint)."""
    ckpt = tmp_path / f"ckpt_{name}"
    full = _train(script, [*_flags(tmp_path, data, table), "--save", str(ckpt), "--save-interval", "2"],
                  tmp_path, f"{name}_full")
    resumed = _train(script, [*_flags(tmp_path, data, table), "--load", str(ckpt), "--ckpt-step", "2"],
                     tmp_path, f"{name}_resumed")
    assert [r["step"] for r in full] == [1, 2, 3, 4] and [r["step"] for r in resumed] == [3, 4]
    # DST acts in the resumed steps (here it raises: the straggler leaves the others slack)
    assert any(r["units_cut"] or r["units_raised"] for r in full[2:]), "DST never moved"
    for a, b in zip(full[2:], resumed, strict=True):
        for key in ("tokens", "mean_density", "density_rank_min", "density_rank_max",
                    "units_cut", "units_raised", "predicted_step_s"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a["loss"], b["loss"])
    return full, resumed


@pytest.fixture(scope="module")
def our_entry_run(tmp_path_factory, small_jsonl, analytic_latency_table_pp2):
    from tests.conftest import HYBRID_ENTRY

    tmp = tmp_path_factory.mktemp("ours")
    return _train_and_resume(HYBRID_ENTRY, tmp, small_jsonl, analytic_latency_table_pp2, "ours")


@pytest.mark.parametrize("branch", list(CHECKOUTS))
def test_patched_pretrain_hybrid_trains_like_our_entry(branch, tmp_path, small_jsonl, request,
                                                       analytic_latency_table_pp2):
    """PP=2 x DP=2 with DST and SAB: the patched script of the branch trains, evaluates,
    checkpoints and resumes, and every step's loss equals our entry's."""
    env, patch = CHECKOUTS[branch]
    if not os.environ.get(env):
        pytest.skip(f"set {env} to a Megatron-LM {branch} checkout to run its pretrain_hybrid.py")
    src = Path(os.environ[env]).resolve()
    copy = tmp_path / "Megatron-LM"
    copy.mkdir()
    for name in ("pretrain_gpt.py", "pretrain_hybrid.py", "hybrid_builders.py",
                 "model_provider.py"):
        shutil.copy2(src / name, copy / name)
    (copy / "megatron").symlink_to(src / "megatron", target_is_directory=True)
    out = run_script(copy, check_rc=0).stdout
    assert f"applied: {copy}/pretrain_hybrid.py ({patch})" in out, out
    patched = (copy / "pretrain_hybrid.py").read_text()
    imports = {(n.module, a.name) for n in ast.walk(ast.parse(patched))
               if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("sparsebalance_megatron.megatron", "hooks") in imports

    theirs = _train_and_resume(copy / "pretrain_hybrid.py", tmp_path, small_jsonl,
                               analytic_latency_table_pp2, branch)
    ours = request.getfixturevalue("our_entry_run")
    for a, b in zip(theirs, ours):       # the uninterrupted runs, then the resumed ones
        assert [r["step"] for r in a] == [r["step"] for r in b]
        for x, y in zip(a, b):
            assert x["tokens"] == y["tokens"] and x["mean_density"] == y["mean_density"]
            assert x["attention_layers_per_stage"] == y["attention_layers_per_stage"] == [1, 1]
            assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"]), (x["loss"], y["loss"])
