"""The hooks the Megatron-LM patch calls (sparsebalance_megatron/megatron/hooks.py), on
Megatron's own objects: its parser (the plugin's flags composed with a script's own, CPU defaults
that flags override), the args defaults with the plugin's data path, ``install`` (a dense run
left alone, a setting it cannot serve refused in one line), the model config (the spec built by
Megatron's own default-spec call, for TE and local, with only the core attention swapped), the
timers and finalize slot; and the patched flow (parse -> gpt_config_from_args -> install ->
Megatron's GPTModelBuilder) builds a GPT with our core attention that runs forward and backward.
The patch itself, its apply script and the real checkouts: test_megatron_patch.py.
"""

from __future__ import annotations

import argparse
import os
import types

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.integration


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
    proc = run_python(["-c", _BUILD, *BUILD_ARGS, "--sb-sparse-attention", "--sb-block-size",
                       "64", "--sb-density", "0.5"], cwd=tmp_path, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("CORE "))
    module, name, _, loss = line.split()[1:]
    assert (module, name) == ("sparsebalance_megatron.megatron.model.core_attention",
                              "SparseCoreAttention"), line
    assert 0 < float(loss) < 20, line
    assert "[sparsebalance] sparse attention: density 0.5, block 64" in proc.stdout
