"""Launch checks of the data path: one packer per launch, and the Megatron data settings the
plugin's packed data path does not serve. ``checks.flag_conflicts`` and ``checks.check_launch``
call them; each returns the problems as lines (empty: nothing to refuse).
Reads parsed arguments only: imports nothing from megatron, no torch.distributed.
"""

from __future__ import annotations

from ...config import SparseBalanceConfig, flag_name

# Megatron's ways to give the data, (flag, its parsed name): the whole data set (split by
# --split) or each split's own; in each, lists on the command line or the file that holds them
WHOLE_DATA = (("--data-path", "data_path"), ("--data-args-path", "data_args_path"))
PER_SPLIT_DATA = (("--train-data-path", "train_data_path"),
                  ("--valid-data-path", "valid_data_path"),
                  ("--test-data-path", "test_data_path"),
                  ("--per-split-data-args-path", "per_split_data_args_path"))


def packer_conflicts(args, sb: SparseBalanceConfig, plugin_data: bool) -> list[str]:
    """One packer per launch. Megatron-LM dev's sequence packing scheduler (``train_step`` wraps
    the data iterator with it: ``--sequence-packing-scheduler``, also chosen by
    ``--dynamic-context-parallel`` and ``--use-varlen-dataset``) repacks whatever micro-batches
    it is given: on the plugin's data path it would repack SAB's (or the sequential plan's)
    micro-batches and drop the keys the plugin's forward step reads (``cu_seqlens``, the
    micro-batch's plan)."""
    if not plugin_data:
        return []
    scheduler = getattr(args, "sequence_packing_scheduler", None)
    if scheduler is not None:
        theirs = f"--sequence-packing-scheduler {scheduler}"
    elif getattr(args, "dynamic_context_parallel", False):
        theirs = ("--dynamic-context-parallel (it packs with Megatron's default_dynamic_cp "
                  "scheduler)")
    elif getattr(args, "use_varlen_dataset", False) and \
            not getattr(args, "varlen_sbhd_validation", False):
        theirs = "--use-varlen-dataset (it packs with Megatron's dp_balanced scheduler)"
    else:
        return []
    ours = [f for f, on in (("--sparse-balance", sb.sparse_balance),
                            ("--sb-batching", sb.batching), ("--sb-dst", sb.dst),
                            (f"{flag_name('packing')} {sb.packing}", sb.packing != "auto")) if on]
    ours = " / ".join(ours) if ours else "the plugin's entry, which always packs"
    return [f"{theirs} with the plugin's packing ({ours}): two packers, Megatron's would repack "
            f"the micro-batches the plugin packed and drop their cu_seqlens and budgets; drop "
            f"{theirs.split(' (')[0]} (SAB already packs, balancing predicted latency where "
            f"Megatron's packer balances tokens), or drop the plugin's packing for Megatron's "
            f"(--sb-sparse-attention alone keeps Megatron's data path)"]


def data_conflicts(args) -> list[str]:
    """Megatron data settings the plugin's packed data path does not serve."""
    out = []
    # pretrain_gpt.loss_func's other losses (loss.MEGATRON_LOSS_ARGS): the plugin's forward step
    # computes the LM loss only.
    if getattr(args, "logits_load_dir", None) is not None:
        out.append(f"--logits-load-dir {args.logits_load_dir} with the plugin's data path (its "
                   f"forward step computes the LM loss, not offline distillation's)")
    if getattr(args, "modelopt_enabled", False):
        out.append("ModelOpt with the plugin's data path (its forward step computes the LM loss, "
                   "not ModelOpt's distillation loss)")
    if getattr(args, "mock_data", False):
        out.append("--mock-data (the plugin's data path packs real documents; give --data-path "
                   "or nothing for the built-in corpus)")
    per_split, whole = ([f for f, dest in ways if getattr(args, dest, None) is not None]
                        for ways in (PER_SPLIT_DATA, WHOLE_DATA))
    for named in (whole, per_split):        # a list and the file that would hold it
        if len(named) > 1 and named[-1].endswith("-args-path"):
            out.append(f"{named[0]} with {named[-1]}: give the data one way (Megatron reads "
                       f"one of them)")
    if whole and per_split:
        out.append(f"{whole[0]} with {per_split[0]}: one data source, the whole data set split by "
                   f"--split or each split's own (Megatron's rule)")
    elif per_split and getattr(args, "split", None) is not None:
        out.append(f"--split {args.split} with {per_split[0]}: each split has its own data sets, "
                   f"whole (Megatron's per-split data takes no --split)")
    if getattr(args, "sft", False):
        out.append("--sft")
    if getattr(args, "fim_data", False):
        out.append("--fim-data")
    if getattr(args, "micro_batch_size", 1) != 1:
        out.append(f"--micro-batch-size {args.micro_batch_size} (packed micro-batches hold whole "
                   f"documents in one row of --seq-length tokens: use --micro-batch-size 1 and "
                   f"raise --seq-length or --global-batch-size)")
    return out


def quality_conflicts(args, sb: SparseBalanceConfig, plugin_data: bool) -> list[str]:
    """What the quality side of DST cannot serve. ``--sb-eval-density trained`` reads DST's
    plans (``step/eval_profile.py``). ``--sb-quality-refresh-interval``
    (``step/quality_probe.py``) refreshes the model DST's quality objective plans by; its
    held-out batch is K micro-batches per DP rank (``--sb-quality-refresh-microbatches``) on
    the plugin's data path, each document's loss whole on one rank (no context-parallel
    split), run by the one-chunk schedules."""
    out = [] if sb.eval_density != "trained" or sb.dst_enabled else [
        f"{flag_name('eval_density')} trained without DST (the profile is the densities DST's "
        f"plans give each stage: --sparse-balance or --sb-dst)"]
    if not sb.quality_refresh_interval:
        return out
    what = f"{flag_name('quality_refresh_interval')} {sb.quality_refresh_interval}"
    if not sb.dst_enabled or sb.dst_objective != "quality":
        out.append(f"{what} without DST's quality objective (the quality model is what it "
                   f"refreshes: --sparse-balance or --sb-dst, with "
                   f"{flag_name('dst_objective')} quality)")
    elif sb.replay_plans:
        out.append(f"{what} with {flag_name('replay_plans')} (the plans are replayed, not made "
                   f"by the model it refreshes)")
    if not plugin_data:
        out.append(f"{what} without the plugin's data path (its held-out micro-batches "
                   f"are packed by it)")
    cp = getattr(args, "context_parallel_size", 1) or 1
    if cp > 1:
        out.append(f"{what} with --context-parallel-size {cp} (a document's loss is split over "
                   f"the CP ranks; the refresh measures it whole): refresh with CP 1")
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vp is not None and vp > 1:
        out.append(f"{what} with the interleaved schedule (virtual pipeline size {vp}): the "
                   f"refresh runs its micro-batches through the one-chunk schedules")
    return out
