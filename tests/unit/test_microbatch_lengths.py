"""``--sb-microbatch-multiple auto`` (``megatron/launch/lengths.py``): variable-length
micro-batches where SAB packs for dense attention on the plugin's data path and nothing needs
fixed shapes, fixed ones otherwise, each with the launch line's reason; a number given is kept.
The resolved number is written into Megatron's args, so every later read of the config (the
planner process, the profiler's command line) sees it."""

from __future__ import annotations

import json
import types

import pytest

from sparsebalance_megatron.arguments import add_sparsebalance_args, config_from_args
from sparsebalance_megatron.config import ConfigError, SparseBalanceConfig
from sparsebalance_megatron.megatron.launch.lengths import (VARIABLE_MULTIPLE,
                                                            apply_length_multiple,
                                                            resolve_length_multiple)


def launch_args(flags=(), **megatron):
    import argparse

    args = add_sparsebalance_args(argparse.ArgumentParser()).parse_args(list(flags))
    base = dict(tensor_model_parallel_size=1, context_parallel_size=1, sequence_parallel=False,
                cuda_graph_impl="none")
    for k, v in {**base, **megatron}.items():
        setattr(args, k, v)
    return args


def resolve(flags=(), plugin_data=True, hybrid=False, **megatron):
    args = launch_args(flags, **megatron)
    return resolve_length_multiple(args, config_from_args(args), plugin_data=plugin_data,
                                   hybrid=hybrid)


def test_the_flag_takes_auto_or_a_number():
    assert SparseBalanceConfig().microbatch_multiple == "auto"
    assert SparseBalanceConfig().length_multiple == 0           # unresolved: fixed
    for v, want in (("128", 128), (128, 128), ("0", 0), (0, 0)):
        assert SparseBalanceConfig(microbatch_multiple=v).length_multiple == want
    for bad in ("-1", -1, "x", True, 1.5):
        with pytest.raises(ConfigError, match="--sb-microbatch-multiple"):
            SparseBalanceConfig(microbatch_multiple=bad)


def test_auto_is_variable_for_sab_with_dense_attention():
    k, why = resolve(["--sb-batching"])
    assert k == VARIABLE_MULTIPLE and "variable-length micro-batches" in why
    assert "--sb-microbatch-multiple 0 keeps" in why
    # raised to what context parallelism's padding and sequence parallelism need
    assert resolve(["--sb-batching"], context_parallel_size=2)[0] == 128
    assert resolve(["--sb-batching"], tensor_model_parallel_size=3, sequence_parallel=True)[0] \
        == 384
    assert resolve(["--sb-batching", "--sb-seq-pad-multiple", "3"])[0] == 384


def test_auto_is_variable_for_sparse_attention_through_triton_or_fa4():
    """The triton and fa4 kernels take any length: sparse attention through them packs as
    dense SAB does; 'auto' off a GPU (which may become flex, a compile per length) and flex keep
    fixed shapes."""
    for backend in ("triton", "fa4"):
        k, why = resolve(["--sparse-balance", "--sb-attention-backend", backend])
        assert k == VARIABLE_MULTIPLE and f"the {backend} kernel takes any length" in why
    for backend in ("auto", "flex", "torch"):
        k, why = resolve(["--sparse-balance", "--sb-attention-backend", backend])
        assert k == 0 and f"through the {backend} backend" in why
        assert "--sb-attention-backend fa4 or triton takes any length" in why
    # what else needs fixed shapes still does
    assert resolve(["--sparse-balance", "--sb-attention-backend", "triton"], hybrid=True)[0] == 0
    assert resolve(["--sparse-balance", "--sb-attention-backend", "triton", "--sb-packing",
                    "token_balanced"])[0] == 0


@pytest.mark.parametrize("flags, kw, named", [
    (["--sparse-balance"], {}, "sparse attention"),
    (["--sb-batching", "--sb-sparse-attention"], {}, "sparse attention"),
    (["--sb-packing", "token_balanced"], {}, "token_balanced packing"),
    ([], {}, "sequential packing"),                  # the plugin's entry, no switch
    (["--sb-batching"], dict(hybrid=True), "a HybridModel"),
    (["--sb-batching"], dict(cuda_graph_impl="transformer_engine"), "CUDA graphs"),
    (["--sb-batching"], dict(enable_cuda_graph=True), "CUDA graphs"),
])
def test_auto_keeps_fixed_shapes_where_something_needs_them(flags, kw, named):
    k, why = resolve(flags, **kw)
    assert k == 0 and why.startswith("fixed --seq-length micro-batches") and named in why


def test_auto_follows_what_a_given_latency_table_can_price(tmp_path):
    one, several = tmp_path / "one.json", tmp_path / "several.json"
    one.write_text(json.dumps({"profile": {"token_totals": [32768]}}))
    several.write_text(json.dumps({"profile": {"token_totals": [8192, 16384, 32768]}}))
    k, why = resolve(["--sb-batching", "--sb-latency-table", str(one)])
    assert k == 0 and "profiled at one token total" in why
    assert resolve(["--sb-batching", "--sb-latency-table", str(several)])[0] == 128
    missing = tmp_path / "missing.json"          # the table's own check names it at launch
    assert resolve(["--sb-batching", "--sb-latency-table", str(missing)])[0] == 0


def test_a_number_given_is_kept_and_megatrons_data_path_is_left_alone():
    assert resolve(["--sb-batching", "--sb-microbatch-multiple", "0"]) == (0, None)
    assert resolve(["--sparse-balance", "--sb-microbatch-multiple", "64"]) == (64, None)
    assert resolve(["--sb-batching"], plugin_data=False) == (0, None)


def test_the_resolved_number_is_what_every_later_read_sees():
    args = launch_args(["--sb-batching"])
    sb, why = apply_length_multiple(args, config_from_args(args), plugin_data=True)
    assert sb.length_multiple == 128 and why
    assert config_from_args(args).microbatch_multiple == "128"     # in Megatron's args
    again, note = apply_length_multiple(args, config_from_args(args), plugin_data=True)
    assert again.length_multiple == 128 and note is None           # resolved once
    fixed = launch_args(["--sparse-balance"])
    sb, why = apply_length_multiple(fixed, config_from_args(fixed), plugin_data=True)
    assert sb.length_multiple == 0 and config_from_args(fixed).microbatch_multiple == "0"


def test_the_planner_packs_at_the_resolved_length():
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.latency import LatencyModel
    from sparsebalance_megatron.megatron.step.drafting import Drafter

    lm = LatencyModel.analytic(pp=2).all_dense()
    segs = [(i, 0, n) for i, n in enumerate([900, 5000, 300, 12000, 700, 2500, 64, 4000])]
    for value, want in (("auto", 0), ("128", 128)):
        sb = SparseBalanceConfig(batching=True, microbatch_multiple=value)
        d = Drafter(sb, lm, SensitivityTracker(), dp=2, capacity=16384,
                    attention_layers=lm.layout.attention_layers)
        plan = d.pack(segs, 2)
        assert plan.length_multiple == want
        lengths = plan.packed_lengths()
        assert (lengths == 16384).all() if want == 0 else (lengths % 128 == 0).all()


def test_a_namespace_without_megatrons_optional_sizes_still_resolves():
    # a namespace lacking Megatron's CUDA-graph and parallel sizes (an older megatron-core)
    args = types.SimpleNamespace(**vars(launch_args(["--sb-batching"])))
    for name in ("cuda_graph_impl", "sequence_parallel", "context_parallel_size",
                 "tensor_model_parallel_size"):
        delattr(args, name)
    assert resolve_length_multiple(args, config_from_args(args), plugin_data=True)[0] == 128


def test_a_replay_takes_the_multiple_its_plans_were_packed_at(tmp_path):
    from sparsebalance_megatron.batching.packing import sequential_plan
    from sparsebalance_megatron.megatron.launch.replay import plan_record

    segs = [(i, 0, n) for i, n in enumerate([100, 60, 200, 40])]
    for k in (0, 64):
        plan = sequential_plan(segs, dp=2, num_microbatches=1,
                               max_tokens=256).with_length_multiple(k)
        path = tmp_path / f"m{k}.jsonl"
        path.write_text(json.dumps({"step": 1, "plan": plan_record(plan, 0, 1, None)}) + "\n")
        got, why = resolve(["--sb-batching", "--sb-replay-plans", str(path)])
        assert got == k and "as the plans of --sb-replay-plans were packed" in why
    # an unreadable file: the usual rule (the replay's own launch check names the file)
    assert resolve(["--sb-batching", "--sb-replay-plans", str(tmp_path / "none.jsonl")])[0] \
        == VARIABLE_MULTIPLE


def test_auto_on_a_gpu_runs_a_length_free_kernel_at_variable_lengths(monkeypatch):
    """On CUDA, where a length-free kernel serves the model, 'auto' runs the first (fa4 where
    flash-attn-4 is installed, else triton) and packs variable lengths (the H200: fixed-length
    sparse runs paid 30% padding); where none can run (here: a head dim they do not take)
    'auto' keeps fixed shapes and its measured pick. The start-up profile then times only
    length-free kernels."""
    import torch

    from sparsebalance_megatron.attention import api
    from sparsebalance_megatron.megatron.launch.crossover import (AUTO_CANDIDATES,
                                                                  auto_candidates)
    from sparsebalance_megatron.megatron.launch.lengths import auto_takes_any_length

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(api, "_AUTO_MEASURED", {})      # what a launch registers is undone
    asked = []

    fa4 = [False]

    def missing(backend, device, *, dtype=None, head_dim=None, block_size=None):
        asked.append((backend, dtype, head_dim, block_size))
        if backend == "fa4" and not fa4[0]:
            return "flash-attn-4 is not installed"
        return None if head_dim in (None, 64, 128) else f"head dim {head_dim}"
    monkeypatch.setattr(api, "backend_missing", missing)
    model = dict(hidden_size=896, num_attention_heads=14, kv_channels=64, bf16=True)
    k, why = resolve(["--sparse-balance"], **model)
    assert k == VARIABLE_MULTIPLE and "--sb-attention-backend auto runs the triton kernel" in why
    assert asked[-1] == ("triton", torch.bfloat16, 64, 64)
    args = launch_args(["--sparse-balance"], **model)
    try:
        sb, _ = apply_length_multiple(args, config_from_args(args), plugin_data=True)
        assert sb.length_multiple == VARIABLE_MULTIPLE
        assert api.auto_backend("cuda")[0] == "triton"
        assert auto_candidates(sb) == ("fa4", "triton")   # the profile times both that run
        fa4[0] = True                                    # flash-attn-4 installed: fa4 first
        k, why = resolve(["--sparse-balance"], **model)
        assert "--sb-attention-backend auto runs the fa4 kernel" in why
        args = launch_args(["--sparse-balance"], **model)
        apply_length_multiple(args, config_from_args(args), plugin_data=True)
        assert api.auto_backend("cuda")[0] == "fa4"
        fa4[0] = False
    finally:
        api.set_auto_backend(None, "")
    assert auto_candidates(SparseBalanceConfig(microbatch_multiple=0)) == AUTO_CANDIDATES
    # a head dim triton does not take: fixed shapes, and 'auto' is left to the profile
    k, why = resolve(["--sparse-balance"], hidden_size=768, num_attention_heads=8, bf16=True)
    assert k == 0 and "through the auto backend" in why and asked[-1][2] == 96
    # without the model's sizes (a namespace lacking them) the head dim is not judged
    assert auto_takes_any_length(launch_args(["--sparse-balance"]), SparseBalanceConfig())
    # a number given with 'auto' where triton cannot run: nothing registered (the launch
    # check names the kernel 'auto' measured, which cannot take the lengths)
    args = launch_args(["--sparse-balance", "--sb-microbatch-multiple", "128"],
                       hidden_size=768, num_attention_heads=8, bf16=True)
    apply_length_multiple(args, config_from_args(args), plugin_data=True)
    assert api.auto_backend("cuda")[0] == api.AUTO_UNMEASURED
    # an explicit backend is not 'auto': flex keeps fixed shapes on a GPU too
    assert resolve(["--sparse-balance", "--sb-attention-backend", "flex"], **model)[0] == 0
