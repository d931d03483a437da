"""The Megatron-LM patch (patches/megatron_lm_pretrain_gpt.patch), its apply script and the hooks.

Always run: the patch is a well-formed unified diff whose hunks target the files it names and
call only hooks that exist; the script refuses a directory that is not a Megatron-LM checkout,
applies the patch to a checkout whose pretrain_gpt.py holds the patch's pre-image, detects it as
already applied, reverts it and refuses a file it does not fit; the hooks work on Megatron's
parser, model config (the spec is built by Megatron's own default-spec call, for TE and local),
timers and finalize slot; the patched flow (parse -> gpt_config_from_args -> install ->
Megatron's GPTModelBuilder) builds a GPT with our core attention that runs forward and backward.
With ``MEGATRON_LM_DIR`` (core_r0.19.0), ``MEGATRON_LM_MAIN_DIR`` (main) and/or
``MEGATRON_LM_DEV_DIR`` (dev) set to real Megatron-LM checkouts: the branch's patch is applied to
a copy, the patched pretrain_gpt.py trains 3 steps with ``--sparse-balance`` (DST + SAB) on 2
ranks, CPU, the sparse kernel selects (kept density below 1), and its losses equal our entry's on
the same data.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import types
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


# --- the hooks ----------------------------------------------------------------------------------

def _megatron_args(argv: list[str]):
    from megatron.training.arguments import add_megatron_arguments

    from sparsebalance_megatron.megatron import hooks

    parser = hooks.extra_args_provider(None)(add_megatron_arguments(argparse.ArgumentParser()))
    return parser.parse_args(argv)


def test_extra_args_provider_composes_with_the_scripts_own():
    from sparsebalance_megatron.megatron import hooks

    def base(parser):
        parser.add_argument("--modelopt-like", type=int, default=3)
        return parser

    args = hooks.extra_args_provider(base)(argparse.ArgumentParser()).parse_args(
        ["--modelopt-like", "5", "--sparse-balance", "--sb-density", "0.25"])
    assert (args.modelopt_like, args.sparse_balance, args.sb_density) == (5, True, 0.25)


def test_extra_args_provider_sets_cpu_defaults_that_flags_override(monkeypatch):
    from sparsebalance_megatron.megatron.launch import checks

    args = _megatron_args(["--seq-length", "128"])
    assert (args.transformer_impl, args.distributed_backend) == ("local", "gloo")
    assert args.gradient_accumulation_fusion is False and args.no_persist_layer_norm is True
    # without transformer-engine the flag is refused as it is parsed (tests/unit/
    # test_parse_time_checks.py); with it, the flag wins over the CPU default
    monkeypatch.setattr(checks, "have_module", lambda name: True)
    assert _megatron_args(["--transformer-impl", "transformer_engine"]).transformer_impl == \
        "transformer_engine"


def test_args_defaults_with_the_plugins_data_path(tmp_path, small_jsonl):
    from sparsebalance_megatron.megatron import hooks

    base = {"tokenizer_type": "GPT2BPETokenizer"}
    # Without DST/SAB, Megatron-LM's script keeps its own defaults and data path.
    assert hooks.args_defaults(base, argv=["--sb-sparse-attention"]) == base
    got = hooks.args_defaults(base, argv=["--sparse-balance", "--data-path", str(small_jsonl),
                                          "--sb-tokenizer", "byte",
                                          "--sb-data-cache-dir", str(tmp_path)])
    # The plugin's tokenizer stands for NullTokenizer; the vocabulary is the data's.
    assert got["tokenizer_type"] == "NullTokenizer" and got["vocab_size"] == 384
    explicit = hooks.args_defaults(base, argv=["--sparse-balance", "--vocab-size", "999"])
    assert "vocab_size" not in explicit
    # A Megatron text tokenizer decides the vocabulary itself.
    hf = hooks.args_defaults(base, argv=["--sparse-balance", "--tokenizer-type",
                                         "HuggingFaceTokenizer"])
    assert "vocab_size" not in hf


def test_args_defaults_reports_unreadable_data_in_one_line(tmp_path):
    """Without a vocabulary size Megatron's parse fails on NullTokenizer next, hiding the cause:
    the data's own error ends the launch here."""
    from sparsebalance_megatron.megatron import hooks

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit) as e:
        hooks.args_defaults({}, argv=["--sparse-balance", "--data-path", str(empty),
                                      "--sb-tokenizer", "byte", "--sb-data-cache-dir",
                                      str(tmp_path / "cache")])
    msg = str(e.value)
    assert msg.startswith("error: ") and str(empty) in msg and "no document" in msg


def test_install_leaves_a_dense_megatron_run_alone():
    from sparsebalance_megatron.megatron import hooks

    cfg = types.SimpleNamespace(transformer_layer_spec=None, post_wrap_hooks=[])
    assert hooks.install(_megatron_args(["--seq-length", "128"]), cfg) is cfg
    assert cfg.transformer_layer_spec is None and cfg.post_wrap_hooks == []


@pytest.mark.parametrize("argv, needle", [
    (["--seq-length", "32", "--sb-sparse-attention", "--sb-block-size", "64"],
     "--seq-length 32 is smaller than --sb-block-size 64"),
    (["--seq-length", "256", "--sb-sparse-attention", "--spec", "local"], "--spec"),
    (["--seq-length", "256", "--sb-sparse-attention", "--num-experts", "4"], "--num-experts 4"),
    (["--seq-length", "256", "--sparse-balance", "--context-parallel-size", "2"],
     "--context-parallel-size 2"),
    (["--seq-length", "256", "--sb-density", "2"], "--sb-density=2.0"),
])
def test_install_refuses_with_one_error_line(argv, needle, capsys):
    from sparsebalance_megatron.megatron import hooks

    cfg = types.SimpleNamespace(transformer_layer_spec=None, post_wrap_hooks=[])
    with pytest.raises(SystemExit) as e:
        hooks.install(_megatron_args(argv), cfg)
    msg = str(e.value)
    assert msg.startswith("error: ") and needle in msg and "\n" not in msg, msg
    assert cfg.transformer_layer_spec is None


def _gpt_config(impl: str):
    from megatron.core.transformer import TransformerConfig
    from megatron.training.models.gpt import GPTModelConfig

    tc = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                           num_query_groups=2, transformer_impl=impl, normalization="RMSNorm",
                           qk_l2_norm=True, pipeline_model_parallel_size=1)
    return GPTModelConfig(transformer=tc, vocab_size=512)


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_spec_is_megatrons_own_call_with_only_core_attention_swapped(impl, monkeypatch):
    """The spec builder calls Megatron's default_layer_spec(config, vp_stage): the TE branch gets
    exactly the arguments its signature accepts (checked by binding them, no TE needed)."""
    import inspect

    import megatron.training.models.gpt as mgpt
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from sparsebalance_megatron.config import SparseBalanceConfig
    from sparsebalance_megatron.megatron.model.core_attention import SparseCoreAttention
    from sparsebalance_megatron.megatron.model.spec import (layer_spec_builder,
                                                            sparse_core_attention_spec)

    calls = []
    real_te, real_local = (mgpt.get_gpt_layer_with_transformer_engine_spec,
                           mgpt.get_gpt_layer_local_spec)

    def te(*a, **kw):
        inspect.signature(real_te).bind(*a, **kw)   # TypeError if a keyword is not accepted
        calls.append(("te", a, kw))
        return get_gpt_layer_local_spec()           # TE modules cannot be built here

    def local(*a, **kw):
        inspect.signature(real_local).bind(*a, **kw)
        calls.append(("local", a, kw))
        return real_local(*a, **kw)

    monkeypatch.setattr(mgpt, "get_gpt_layer_with_transformer_engine_spec", te)
    monkeypatch.setattr(mgpt, "get_gpt_layer_local_spec", local)
    core = sparse_core_attention_spec(SparseBalanceConfig(sparse_attention=True))
    spec = layer_spec_builder(core)(_gpt_config(impl), vp_stage=None)
    assert [c[0] for c in calls] == ["te" if impl == "transformer_engine" else "local"]
    if impl == "transformer_engine":
        assert calls[0][2]["qk_l2_norm"] is True            # upstream's flags reach the spec
    got = spec.submodules.self_attention.submodules.core_attention
    assert got is core and got.module is SparseCoreAttention
    stock = get_gpt_layer_local_spec()
    stock.submodules.self_attention.submodules.core_attention = got
    if impl == "local":
        assert repr(spec) == repr(stock)                   # nothing else changed


def test_timer_tee_records_microbatches_and_keeps_megatrons_timers():
    from sparsebalance_megatron.megatron.step.timing import MicrobatchTimers, TeeTimers

    class MegatronLikeTimers:
        def __init__(self):
            self.calls = []

        def __call__(self, name, log_level=None):
            timers = self

            class _T:
                def start(self, barrier=False):
                    timers.calls.append((name, "start"))

                def stop(self, barrier=False):
                    timers.calls.append((name, "stop"))

            return _T()

        def log(self, names):
            return f"logged {names}"

    megatron_timers = MegatronLikeTimers()
    tee = TeeTimers(megatron_timers, MicrobatchTimers(use_cuda_events=False))
    tee("forward-backward", log_level=1).start()
    for _ in range(3):   # the schedule's shape
        tee("forward-compute", log_level=2).start()
        tee("forward-compute").stop()
        tee("backward-compute", log_level=2).start()
        tee("backward-compute").stop()
    timings = tee.ours.step_timings()
    assert len(timings["fwd_s"]) == 3 and len(timings["bwd_s"]) == 3
    assert timings["step_s"] is not None and timings["step_s"] >= 0
    assert megatron_timers.calls.count(("forward-compute", "stop")) == 3
    assert tee.log(["x"]) == "logged ['x']"
    assert tee.ours.step_timings()["fwd_s"] == [], "a new step starts empty"
    tee("forward-backward").stop()


def test_timer_tee_targets_megatrons_global_timers():
    """The tee replaces megatron.training.global_vars._GLOBAL_TIMERS (what train() puts in
    config.timers): fail loudly if megatron-core moves it."""
    from megatron.training import global_vars

    assert hasattr(global_vars, "_GLOBAL_TIMERS") and callable(global_vars.get_timers)


_BUILD = r"""
import sys
import torch
from sparsebalance_megatron.megatron.launch import compat
from sparsebalance_megatron.megatron import hooks
compat.activate_cpu_shims()
from megatron.training.arguments import parse_args, validate_args
from megatron.training.argument_utils import gpt_config_from_args
from megatron.training.global_vars import set_global_variables
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
args = parse_args(extra_args_provider=hooks.extra_args_provider(None))  # as the patched script
validate_args(args, {})
set_global_variables(args, build_tokenizer=False)
args.padded_vocab_size = 512
model_cfg = gpt_config_from_args(args)
hooks.install(args, model_cfg)
torch.distributed.init_process_group("gloo", world_size=1, rank=0)
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1)
model = model_cfg.get_builder_cls()(model_cfg).build_model(
    ProcessGroupCollection.use_mpu_process_groups(), pre_process=True, post_process=True)
core = model.decoder.layers[0].self_attention.core_attention
tokens = torch.randint(0, 500, (1, 256))
loss = model(tokens, torch.arange(256)[None], None, labels=tokens).float().mean()
loss.backward()
print("CORE", type(core).__module__, type(core).__name__, "LOSS", float(loss), flush=True)
"""

BUILD_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "256",
    "--max-position-embeddings", "256", "--micro-batch-size", "1", "--global-batch-size", "1",
    "--lr", "1e-3", "--train-iters", "1", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--vocab-size", "512", "--tokenizer-type", "NullTokenizer",
]


def test_hooked_model_config_builds_a_sparse_gpt_with_megatrons_builder(tmp_path):
    """The patched flow on megatron-core 0.19: parse -> gpt_config_from_args -> install ->
    GPTModelBuilder builds a GPT whose core attention is ours; forward and backward run."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1",
               RANK="0", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _BUILD, *BUILD_ARGS, "--sb-sparse-attention",
                           "--sb-block-size", "64", "--sb-density", "0.5"], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("CORE "))
    module, name, _, loss = line.split()[1:]
    assert (module, name) == ("sparsebalance_megatron.megatron.model.core_attention",
                              "SparseCoreAttention"), line
    assert 0 < float(loss) < 20, line
    assert "[sparsebalance] sparse attention: density 0.5, block 64" in proc.stdout


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
