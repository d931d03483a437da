"""The Megatron-LM patch (patches/megatron_lm_pretrain_gpt.patch), its apply script and its hooks.

Always run: the patch is a well-formed unified diff whose hunks target the files it names; the
script refuses a directory that is not a Megatron-LM checkout, applies the patch to a checkout
whose pretrain_gpt.py holds the patch's pre-image, detects it as already applied, reverts it and
refuses a file it does not fit; the hooks the patch calls work on Megatron's parser, model config,
timers and finalize slot, and the patched flow (parse -> gpt_config_from_args -> install ->
Megatron's GPTModelBuilder) builds a GPT with our core attention that runs forward and backward.
With ``MEGATRON_LM_DIR`` set (a real Megatron-LM checkout): the patch is applied to a copy, the
patched pretrain_gpt.py compiles, calls only hooks that exist, and its argument parser knows
our flags (a bad ``--sb-anchor`` is refused as our flag's bad choice).
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
    # The three wiring points: our flags, the layer spec + finalize hook, the wrapped forward step.
    for call in ("extra_args_provider(", "install(args, model_cfg)", "wrap_forward_step(forward_step)"):
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
    changed = original.replace("forward_step,", "my_forward_step,")
    assert changed != original
    ckpt = fake_checkout(tmp_path / "Megatron-LM", changed)
    out = run_script(ckpt, check_rc=1).stdout
    assert "does not apply" in out and "patches/README.md" in out
    assert (ckpt / "pretrain_gpt.py").read_text() == changed, "a failed apply touched the file"


# --- the hooks the patch calls -----------------------------------------------------------------

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


def test_install_leaves_a_dense_run_alone():
    from sparsebalance_megatron.megatron import hooks

    cfg = types.SimpleNamespace(transformer_layer_spec=None, post_wrap_hooks=[])
    hooks.install(_megatron_args(["--seq-length", "128"]), cfg)
    assert cfg.transformer_layer_spec is None and cfg.post_wrap_hooks == []


@pytest.mark.parametrize("argv, needle", [
    (["--seq-length", "32", "--sparse-balance", "--sb-block-size", "64"], "--seq-length=32"),
    (["--seq-length", "256", "--sb-sparse-attention", "--spec", "local"], "--spec"),
    (["--seq-length", "256", "--sparse-balance", "--num-experts", "4"], "--num-experts 4"),
])
def test_install_refuses_what_the_sparse_spec_cannot_serve(argv, needle):
    from sparsebalance_megatron.megatron import hooks
    from sparsebalance_megatron.megatron.initialize import LaunchError

    cfg = types.SimpleNamespace(transformer_layer_spec=None, post_wrap_hooks=[])
    with pytest.raises(LaunchError, match=re.escape(needle)):
        hooks.install(_megatron_args(argv), cfg)
    assert cfg.transformer_layer_spec is None


def test_install_puts_the_sparse_spec_on_the_model_config():
    pytest.importorskip("sparsebalance_megatron.megatron.spec",
                        reason="get_sparsebalance_layer_spec not written yet")
    from sparsebalance_megatron.megatron import hooks

    args = _megatron_args(["--seq-length", "256", "--sparse-balance", "--transformer-impl", "local"])
    cfg = types.SimpleNamespace(transformer_layer_spec=None, post_wrap_hooks=[])
    hooks.install(args, cfg)
    core = cfg.transformer_layer_spec.submodules.self_attention.submodules.core_attention
    assert "sparsebalance" in getattr(core, "module", core).__module__
    assert cfg.post_wrap_hooks == [hooks._install_finalize]


class _MegatronLikeTimers:
    """Megatron's ``Timers`` call shape (``__call__(name, log_level)``, start/stop), without CUDA."""

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


def test_timer_tee_and_finalize_hook_record_microbatch_timings(monkeypatch):
    from sparsebalance_megatron.megatron import hooks
    from sparsebalance_megatron.megatron.timing import MicrobatchTimers

    monkeypatch.setattr(hooks, "_state", hooks._State())
    hooks._state.timers = MicrobatchTimers(use_cuda_events=False)
    megatron_timers = _MegatronLikeTimers()
    finalized = []
    config = types.SimpleNamespace(timers=megatron_timers,
                                   finalize_model_grads_func=lambda *a, **k: finalized.append(a))
    model = types.SimpleNamespace(config=config)

    seen = []
    step = hooks.wrap_forward_step(lambda it, m: seen.append(m) or ("out", None))
    assert hooks.wrap_forward_step(step) is step
    for _ in range(3):  # the schedule: timer start, forward_step, stop; then backward
        config.timers("forward-compute", log_level=2).start()
        assert step(iter(()), model) == ("out", None)
        config.timers("forward-compute").stop()
        config.timers("backward-compute", log_level=2).start()
        config.timers("backward-compute").stop()
    assert isinstance(config.timers, hooks.TeeTimers) and len(seen) == 3
    # Megatron's own timers still see every start/stop, and its other methods pass through.
    assert megatron_timers.calls.count(("forward-compute", "stop")) == 3
    assert megatron_timers.calls.count(("backward-compute", "start")) == 3
    assert config.timers.log(["x"]) == "logged ['x']"

    assert hooks._install_finalize([model]) == [model]
    hooks._install_finalize([model])  # idempotent: not wrapped twice
    config.finalize_model_grads_func(["m"], None)
    timings = hooks.last_microbatch_timings()
    # The first forward started before the tee was installed; the other intervals are all there.
    assert len(timings["fwd_s"]) == 2 and len(timings["bwd_s"]) == 3
    assert finalized == [(["m"], None)]
    assert hooks._state.timers.durations_s("forward-compute") == [], "not reset after the step"


_BUILD = r"""
import sys
import torch
from sparsebalance_megatron.megatron import compat, hooks
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
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--transformer-impl", "local",
    "--vocab-size", "512", "--tokenizer-type", "NullTokenizer", "--distributed-backend", "gloo",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
    "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
]


def test_hooked_model_config_builds_a_sparse_gpt_with_megatrons_builder(tmp_path):
    """The patched flow on megatron-core 0.19: parse -> gpt_config_from_args -> install ->
    GPTModelBuilder builds a GPT whose core attention is ours; forward and backward run."""
    pytest.importorskip("sparsebalance_megatron.megatron.spec")
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
    line = next(l for l in proc.stdout.splitlines() if l.startswith("CORE "))
    module, name, _, loss = line.split()[1:]
    assert module.startswith("sparsebalance_megatron.megatron"), line
    assert 0 < float(loss) < 20, line
    assert "[sparsebalance] sparse attention on: density 0.5, block 64" in proc.stdout


# --- a real Megatron-LM checkout ---------------------------------------------------------------

@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"),
                    reason="set MEGATRON_LM_DIR to a Megatron-LM checkout to apply the patch to it")
def test_patch_applies_to_megatron_lm_checkout(tmp_path):
    src = Path(os.environ["MEGATRON_LM_DIR"]).resolve()
    copy = tmp_path / "Megatron-LM"
    copy.mkdir()
    for name in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py"):
        if (src / name).exists():
            shutil.copy2(src / name, copy / name)
    (copy / "megatron").symlink_to(src / "megatron", target_is_directory=True)

    out = run_script(copy).stdout
    assert "applied" in out, out
    assert "already applied" in run_script(copy, check_rc=0).stdout
    patched = (copy / "pretrain_gpt.py").read_text()
    tree = ast.parse(patched)  # compiles
    compile(patched, str(copy / "pretrain_gpt.py"), "exec")
    imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               for a in n.names}
    assert ("sparsebalance_megatron.megatron", "hooks") in imports
    test_patch_calls_only_existing_hooks()

    # Megatron's parser with our provider, through the patched script itself. (Not --help:
    # megatron-core 0.19.2's own help text has an unescaped '%' and argparse fails to format it.)
    # A bad value of one of our flags must be refused by argparse as *our* flag's bad choice,
    # before anything is initialised; unpatched, it would be an unrecognized argument.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), str(REPO)]))
    proc = subprocess.run([sys.executable, str(copy / "pretrain_gpt.py"), "--sparse-balance",
                           "--sb-anchor", "avg"], cwd=copy, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert "argument --sb-anchor: invalid choice: 'avg'" in proc.stdout, proc.stdout[-4000:]
    assert "unrecognized arguments" not in proc.stdout
