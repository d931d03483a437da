"""Megatron-LM dev's patches, the apply script's choice between a script's patches, and a
``model_provider`` that can never stand in for the plugin's model.

Always run: patches/megatron_lm_dev_pretrain_{gpt,hybrid}.patch are well-formed diffs of their
script adding the plugin's calls (dev's GPT flow through ``hooks.model_config``), calling only
hooks that exist; the apply script gives each script the patch that fits (a core_r0.19.0/main
GPT script and a dev hybrid one in the same checkout), detects both as applied, reverts both,
and changes nothing when neither patch fits; ``hooks.model_config`` returns None with the plugin
off (the script's model_provider builds the model) and the installed config with it on; and in
Megatron's ``pretrain()`` a container holding the installed config is built with the plugin's
attention, the sparse kernel called, however a ``model_provider`` is passed beside it, while a
container without it is refused in one line before any data is built.
The real dev checkout (``MEGATRON_LM_DEV_DIR``) trains in test_megatron_patch.py and
test_megatron_hybrid_patch.py.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import types
from pathlib import Path

import pytest

from tests.integration.test_megatron_hooks import BUILD_ARGS, _megatron_args
from tests.conftest import PLANNER_THREAD, run_python
from tests.integration.test_megatron_patch import parse_patch, pre_image, run_script

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches"
DEV_GPT = PATCHES / "megatron_lm_dev_pretrain_gpt.patch"
DEV_HYBRID = PATCHES / "megatron_lm_dev_pretrain_hybrid.patch"
MAIN_GPT = PATCHES / "megatron_lm_pretrain_gpt.patch"
MAIN_HYBRID = PATCHES / "megatron_lm_pretrain_hybrid.patch"

pytestmark = pytest.mark.integration


def _added(patch: Path, target: str) -> str:
    files = parse_patch(patch.read_text())
    assert set(files) == {target}
    return "\n".join(b[1:] for h in files[target] for b in h["lines"] if b[:1] == "+")


@pytest.mark.parametrize("patch, target, calls", [
    (DEV_GPT, "pretrain_gpt.py",
     ('extra_args_provider(', 'model="gpt"', "args_defaults(",
      "model_config(args, gpt_config_from_args)", "pretrain_cfg_container_from_args(args, model_cfg)",
      "datasets_provider(train_valid_test_datasets_provider)", "forward_step(forward_step)",
      "sparsebalance_hooks.finish()")),
    (DEV_HYBRID, "pretrain_hybrid.py",
     ('extra_args_provider(', 'model="hybrid"', "args_defaults(", "install(args, model_cfg)",
      "datasets_provider(train_valid_test_datasets_provider)", "forward_step(forward_step)",
      "sparsebalance_hooks.finish()")),
    (MAIN_GPT, "pretrain_gpt.py", ('model="gpt"', "install(args, model_cfg)")),
    (MAIN_HYBRID, "pretrain_hybrid.py", ('model="hybrid"', "install(args, model_cfg)")),
])
def test_each_patch_adds_the_calls_of_its_flow(patch, target, calls):
    from sparsebalance_megatron.megatron import hooks

    added = _added(patch, target)
    for call in calls:
        assert call in added, f"{patch.name} does not add {call}"
    used = set(re.findall(r"sparsebalance_hooks\.(\w+)", added))
    assert used and all(callable(getattr(hooks, n, None)) for n in used), used


def test_the_dev_gpt_patch_keeps_devs_model_provider():
    """With the plugin off, dev's own flow: the container without a model, model_provider."""
    hunk = parse_patch(DEV_GPT.read_text())["pretrain_gpt.py"][0]["lines"]
    assert " " + "        model_provider=partial(model_provider, gpt_builder)," in hunk
    assert "-    full_config = pretrain_cfg_container_from_args(args)" in hunk


def _checkout(root: Path, gpt: str, hybrid: str) -> Path:
    (root / "megatron" / "training").mkdir(parents=True)
    (root / "pretrain_gpt.py").write_text(gpt)
    (root / "pretrain_hybrid.py").write_text(hybrid)
    return root


def test_the_script_gives_each_file_the_patch_that_fits(tmp_path):
    gpt = pre_image(parse_patch(MAIN_GPT.read_text())["pretrain_gpt.py"])
    hybrid = pre_image(parse_patch(DEV_HYBRID.read_text())["pretrain_hybrid.py"])
    ckpt = _checkout(tmp_path / "Megatron-LM", gpt, hybrid)
    out = run_script("--check", ckpt, check_rc=0).stdout
    assert f"applies cleanly to {ckpt}/pretrain_gpt.py ({MAIN_GPT.name})" in out
    assert f"applies cleanly to {ckpt}/pretrain_hybrid.py ({DEV_HYBRID.name})" in out
    out = run_script(ckpt, check_rc=0).stdout
    assert f"applied: {ckpt}/pretrain_hybrid.py ({DEV_HYBRID.name})" in out
    assert 'model="hybrid"' in (ckpt / "pretrain_hybrid.py").read_text()
    out = run_script(ckpt, check_rc=0).stdout
    assert out.count("already applied") == 2 and DEV_HYBRID.name in out
    assert run_script("--revert", ckpt, check_rc=0).stdout.count("reverted") == 2
    assert (ckpt / "pretrain_gpt.py").read_text() == gpt
    assert (ckpt / "pretrain_hybrid.py").read_text() == hybrid


def test_the_dev_gpt_pre_image_takes_the_dev_patch(tmp_path):
    gpt = pre_image(parse_patch(DEV_GPT.read_text())["pretrain_gpt.py"])
    hybrid = pre_image(parse_patch(MAIN_HYBRID.read_text())["pretrain_hybrid.py"])
    ckpt = _checkout(tmp_path / "Megatron-LM", gpt, hybrid)
    out = run_script(ckpt, check_rc=0).stdout
    assert f"applied: {ckpt}/pretrain_gpt.py ({DEV_GPT.name})" in out
    assert "model_config(args, gpt_config_from_args)" in (ckpt / "pretrain_gpt.py").read_text()


def test_no_patch_fits_nothing_changes_and_both_are_named(tmp_path):
    gpt = pre_image(parse_patch(DEV_GPT.read_text())["pretrain_gpt.py"]).replace(
        "        forward_step,", "        my_forward_step,")
    hybrid = pre_image(parse_patch(DEV_HYBRID.read_text())["pretrain_hybrid.py"])
    ckpt = _checkout(tmp_path / "Megatron-LM", gpt, hybrid)
    out = run_script(ckpt, check_rc=1).stdout
    assert f"error: no patch applies to {ckpt}/pretrain_gpt.py" in out
    assert MAIN_GPT.name in out and DEV_GPT.name in out and "Nothing was changed" in out
    assert (ckpt / "pretrain_gpt.py").read_text() == gpt
    assert (ckpt / "pretrain_hybrid.py").read_text() == hybrid


# --- hooks.model_config ---------------------------------------------------------------------------

def test_model_config_is_none_with_the_plugin_off():
    from sparsebalance_megatron.megatron import hooks

    def build(args):
        raise AssertionError("built a model config for a stock run")

    assert hooks.model_config(_megatron_args(["--seq-length", "128"]), build) is None


def test_model_config_is_the_installed_config_with_the_plugin_on():
    from sparsebalance_megatron.megatron import hooks

    cfg = types.SimpleNamespace(transformer_layer_spec=None, post_wrap_hooks=[])
    args = _megatron_args(["--seq-length", "256", "--sb-sparse-attention", "--sb-block-size",
                           "64"])
    assert hooks.model_config(args, lambda a: cfg) is cfg
    assert callable(cfg.transformer_layer_spec) and hooks._on_model_built in cfg.post_wrap_hooks


def test_model_config_refuses_like_install():
    from sparsebalance_megatron.megatron import hooks

    args = _megatron_args(["--seq-length", "256"])
    args.sb_sparse_attention, args.num_experts = True, 4    # past the parser, as validated
    with pytest.raises(SystemExit, match="error: cannot launch: --num-experts 4"):
        hooks.model_config(args, lambda a: types.SimpleNamespace(transformer_layer_spec=None,
                                                                 post_wrap_hooks=[]))


# --- model_provider beside the container ---------------------------------------------------------

_PRETRAIN = r"""
import sys
from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
import sparsebalance_megatron.megatron.model.core_attention as core_attention
from sparsebalance_megatron.megatron import hooks

calls = [0]
kernel = core_attention.block_sparse_attention

def counted(*a, **kw):
    calls[0] += 1
    return kernel(*a, **kw)

core_attention.block_sparse_attention = counted
provider_calls = [0]

def dense_model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                         pg_collection=None):
    # Megatron's own dense GPT: what a model_provider that bypassed the plugin would train
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.global_vars import get_args
    provider_calls[0] += 1
    args = get_args()
    return GPTModel(config=core_transformer_config_from_args(args),
                    transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.seq_length,
                    pre_process=pre_process, post_process=post_process,
                    pg_collection=pg_collection)

with_model = sys.argv.pop(1) == "with_model"
args = parse_and_validate_args(
    extra_args_provider=hooks.extra_args_provider(packed_data=True, model="gpt"),
    args_defaults=hooks.args_defaults(packed_data=True))
model_cfg = hooks.model_config(args, gpt_config_from_args, packed_data=True)
# without_model: dev's container (no model) beside the installed config, the provider builds
pretrain(pretrain_cfg_container_from_args(args, model_cfg if with_model else None),
         hooks.datasets_provider(),
         ModelType.encoder_or_decoder, hooks.forward_step(), model_provider=dense_model_provider)
print("SPARSE_CALLS", calls[0], "PROVIDER_CALLS", provider_calls[0], flush=True)
hooks.finish()
"""


@pytest.fixture(scope="module")
def analytic_table_pp1(tmp_path_factory) -> Path:
    from sparsebalance_megatron.latency.analytic import analytic_table
    from sparsebalance_megatron.latency.shape import ModelShape
    from sparsebalance_megatron.latency.table import write_table

    shape = ModelShape(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
                       num_query_groups=2, vocab_size=512, seq_length=256, pp=1)
    out = tmp_path_factory.mktemp("lat") / "analytic_pp1.json"
    write_table(analytic_table(shape, pp=1, block_size=64, transformer_impl="local"), str(out))
    return out


def _pretrain(tmp_path: Path, mode: str, table: Path, data: Path) -> subprocess.CompletedProcess:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1",
               RANK="0", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    script = tmp_path / "pretrain_hand_wired.py"
    script.write_text(_PRETRAIN)
    argv = [a for a in BUILD_ARGS if a not in ("--tokenizer-type", "NullTokenizer")]
    argv += ["--train-iters", "2", "--eval-iters", "0", "--data-path", str(data),
             "--sparse-balance", "--sb-block-size", "64", "--sb-density", "0.5",
             "--sb-tokenizer", "byte", "--sb-data-cache-dir", str(tmp_path / "cache"),
             "--sb-latency-table", str(table), "--sb-latency-table-force",
             "--sb-timing-source", "model", "--sb-dense-below-tokens", "0", *PLANNER_THREAD]
    return run_python([script, mode, *argv], cwd=tmp_path, env=env, timeout=400)


def test_pretrain_builds_the_installed_config_not_the_model_provider(tmp_path, small_jsonl,
                                                                     analytic_table_pp1):
    """megatron-core's pretrain() builds the container's model whenever it has one (main,
    core_r0.19.0 and dev alike): with the installed config in it, a model_provider passed beside
    it (here one that would build Megatron's dense GPT) is never called, and training runs the
    plugin's sparse kernel."""
    proc = _pretrain(tmp_path, "with_model", analytic_table_pp1, small_jsonl)
    assert proc.returncode == 0, proc.stdout[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("SPARSE_CALLS"))
    _, sparse, _, provider = line.split()
    assert int(provider) == 0 and int(sparse) > 0, line


def test_a_model_from_the_model_provider_is_refused_before_the_data(tmp_path, small_jsonl,
                                                                    analytic_table_pp1):
    """hooks.model_config ran, but the container passed to pretrain() lacks its config (dev's
    flow half wired): pretrain() builds model_provider's dense model, and the launch ends in one
    line before any data is built or any step runs."""
    proc = _pretrain(tmp_path, "without_model", analytic_table_pp1, small_jsonl)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "pretrain() built the model from a config that " \
        "hooks.install(args, model_cfg) did not change" in lines[0], proc.stdout[-4000:]
    assert "model_provider" in lines[0]
    assert "SPARSE_CALLS" not in proc.stdout and "iteration        1/" not in proc.stdout
