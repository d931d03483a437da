"""The trained-quality study's GPU form (``scripts/bench.py trained_quality_gpu``) on the CPU, at
its cheapest: a bundle of a 2-layer cut of SmolLM2 prepared here (how the device plan carries a
bundle in pieces: ``test_gpu_check.py``), and the study run from it: the packed weights
converted to a release checkpoint,
one arm (``--sparse-balance``) continued for a step by two ranks over gloo with
``--local-rank 0`` (what shares one GPU there), evaluated at density 1 and d0, the JSON complete.
The other arms' flags are ``trained_quality.ARMS`` (continued_quality's test trains dense, static
and --sparse-balance with the same flags). What the numbers say is not checked."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import REPO, script_launch_env

pytestmark = pytest.mark.distributed
pytest.importorskip("gguf")
pytest.importorskip("transformers")


def test_gpu_form_runs_on_cpu_from_a_prepared_bundle(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from studies import trained_quality as tq
    from studies import trained_quality_gpu as tqg
    bundle = tmp_path / "bundle"
    assert tqg.main(["--prepare", str(bundle), "--num-layers", "2", "--seq-length", "384",
                     "--min-doc", "128", "--train-docs", "12", "--eval-lengths", "256",
                     "--depths", "0.2", "0.8", "--eval-samples", "1", "--tasks",
                     "needle_single", "variable_tracking", "--block-size", "32"]) == 0
    made = json.loads((bundle / "bundle.json").read_text())
    assert made["architecture"]["num_layers"] == 2 and made["heldout"] == 4
    probe = made["dst_probe"]                   # DST on the bundle's steps, before any device
    assert probe["steps"] >= 1 and 0 <= probe["steps_cut"] <= probe["steps"]
    assert 0 < probe["predicted_step_vs_static"] <= 1.0
    for k, v in script_launch_env().items():     # the study's ranks: the suite's forked ones
        monkeypatch.setenv(k, v)
        monkeypatch.setitem(tq.ENV, k, v)
    out = tmp_path / "q.json"
    assert tqg.main(["--bundle", str(bundle), "--out", str(tmp_path / "runs"), "--device", "cpu",
                     "--steps", "1", "--global-batch-size", "2", "--arms", "sparse_balance",
                     "--budget-s", "86400",      # no arm left out however loaded the machine
                     "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    for key in ("command", "commit", "versions", "config", "bundle", "runs", "paired",
                "densities", "train_wall_s", "eval_wall_s", "wall_s"):
        assert key in doc, key
    assert doc["dp"] == 2 and "dp2_error" not in doc and doc["left_out"] == []
    assert doc["timing_source"] == "model" and doc["evaluated"] == ["sparse_balance"]
    run = doc["runs"]["sparse_balance"]["1"]
    assert run["train"]["steps"] == 1 and run["primary"] == "0.25"
    assert 0 < run["train"]["doc_kept_density"] <= 1
    assert set(run["eval"]) == {"1", "0.25"}
    for ev in run["eval"].values():
        assert all(math.isfinite(ev[k]) for k in ("heldout_loss", "accuracy",
                                                    "token_accuracy", "eval_kept_density"))
        assert set(ev["accuracy_by_task_length"]) == {"needle_single@256",
                                                      "variable_tracking@256"}
        assert set(ev["accuracy_by_depth"]) == {"0.2", "0.8"}
    # dense attention keeps every causal block; d0 keeps fewer
    assert run["eval"]["0.25"]["eval_kept_density"] < run["eval"]["1"]["eval_kept_density"]


def test_gpu_flags_of_each_arm(monkeypatch):
    """On the GPU: bf16, the sparse arms on triton at any length with modelled timings, the
    dense arm through cuDNN, two ranks on one device over gloo (DP 1: NCCL)."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from studies import trained_quality_gpu as tqg
    args = tqg.parse_args(["--prepare", "x"])
    # the pair the targets compare trains first: the budget may leave the last arm out
    assert args.arms == ["static", "sparse_balance", "dense", "dst_density"]
    arch = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 192,
            "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 16,
            "rotary_base": 1e4, "layernorm_epsilon": 1e-5, "tie_embeddings": True}

    def flags(arm, dp):
        cmd = tqg.train_cmd(args, arch, arm, dp, "B", "I", "R")
        return dict(zip(cmd, cmd[1:])), cmd
    for arm in ("dense", "static", "sparse_balance", "dst_density"):
        f, cmd = flags(arm, 2)
        assert f["--distributed-backend"] == "gloo" and f["--local-rank"] == "0", arm
        assert "--bf16" in cmd and f["--sb-dense-kernel"] == "sdpa", arm
        assert f["--transformer-impl"] == "local" and "--no-rope-fusion" in cmd, arm
        assert "--untie-embeddings-and-output-weights" not in cmd
        if arm == "dense":
            assert "--sb-density" not in f and "--sb-attention-backend" not in f
        else:
            assert f["--sb-attention-backend"] == "triton" and f["--sb-density"] == "0.25"
            assert f["--sb-timing-source"] == "model" and f["--sb-dense-below-tokens"] == "0"
            assert f["--sb-block-size"] == "128"
    assert flags("static", 1)[0]["--distributed-backend"] == "nccl"
    assert "--sparse-balance" in flags("sparse_balance", 2)[1]
    assert flags("dst_density", 2)[0]["--sb-dst-objective"] == "density"


def test_gpu_flags_pass_the_entrys_launch_checks_on_a_cuda_machine(tmp_path, monkeypatch):
    """Each arm's GPU command line, parsed by the entry's parser (Megatron's and the plugin's
    flags) as on the device (CUDA, no transformer-engine, no apex): no launch check refuses it,
    at parse time or after (``check_launch``). Without ``--transformer-impl local`` and the
    fusions off, the device would stop every arm at launch."""
    import shutil

    import torch
    from megatron.training.arguments import parse_args

    from sparsebalance_megatron.arguments import config_from_args
    from sparsebalance_megatron.megatron import hooks
    from sparsebalance_megatron.megatron.launch.checks import check_launch
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from studies import trained_quality_gpu as tqg
    bundle, run_dir = tmp_path / "bundle", tmp_path / "run"
    bundle.mkdir()
    run_dir.mkdir()
    shutil.copy(REPO / "docs/results/latency_gpu_h200_fa4.json", bundle / "latency.json")
    args = tqg.parse_args(["--prepare", "x"])
    arch = {"num_layers": 30, "hidden_size": 576, "ffn_hidden_size": 1536,
            "num_attention_heads": 9, "num_query_groups": 3, "kv_channels": 64,
            "rotary_base": 1e5, "layernorm_epsilon": 1e-5, "tie_embeddings": True}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for arm in tqg.ARM_ORDER:
        cmd = tqg.train_cmd(args, arch, arm, 2, str(bundle), str(tmp_path / "init"),
                            str(run_dir))
        flags = cmd[cmd.index("examples/pretrain_gpt_sparsebalance.py") + 1:]
        monkeypatch.setattr("sys.argv", ["pretrain_gpt_sparsebalance.py", *flags])
        parsed = parse_args(extra_args_provider=hooks.extra_args_provider(packed_data=True,
                                                                          model="gpt"))
        assert parsed.transformer_impl == "local" and not parsed.apply_rope_fusion, arm
        check_launch(parsed, config_from_args(parsed), plugin_data=True)
