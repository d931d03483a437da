"""The plugin's resume state inside Megatron's checkpoint folder of an iteration.

Saving goes through Megatron's own hook for external data loaders: with ``args.dataloader_save``
set to ``--save`` (``hooks.install``), every ``save_checkpoint`` calls the train iterator's
``save_state()`` and writes it to ``<save>/iter_NNNNNNN/mp_rank_00[_000]/train_dataloader_dprankNNN.pt``
before it writes ``latest_checkpointed_iteration.txt``, so a checkpoint that Megatron resumes from
always has its plugin state next to the weights. ``load_plugin_state`` reads it back with errors
that name the file.
"""

from __future__ import annotations

import os

import torch

from .launch import LaunchError

STATE_BASENAME = "train_dataloader_dprank000.pt"


def plugin_state_path(args, load_dir: str, iteration: int) -> str:
    from megatron.training.checkpointing import get_checkpoint_name

    return get_checkpoint_name(load_dir, iteration,
                               pipeline_parallel=args.pipeline_model_parallel_size > 1,
                               tensor_rank=0, pipeline_rank=0, expert_parallel=False,
                               expert_rank=0, basename=STATE_BASENAME)


def load_plugin_state(args, load_dir: str, iteration: int, *, fresh: bool = False):
    """The state the callback saved with the checkpoint of ``iteration``; None (start the
    balancer fresh) when there is none and ``fresh`` (--sb-fresh-state) says so."""
    from .callback import STATE_VERSION

    path = plugin_state_path(args, load_dir, iteration)
    if not os.path.exists(path):
        if fresh:
            from .comm import say
            say(f"no SparseBalance state at {path}: starting the balancer fresh "
                f"(--sb-fresh-state)")
            return None
        raise LaunchError(
            f"resuming iteration {iteration} from {load_dir}: no SparseBalance state at {path} "
            f"(the checkpoint was written without the plugin's data path, or with the "
            f"interleaved schedule, where megatron-core 0.19-0.20 saves no data loader "
            f"state); pass --sb-fresh-state to start the balancer fresh, or load the weights "
            f"with --finetune")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        state = saved["dataloader_state_dict"]
        version, it = int(state["version"]), int(state["iteration"])
    except Exception as e:  # truncated, not a dict, missing keys
        raise LaunchError(f"SparseBalance state {path} cannot be read ({type(e).__name__}: "
                          f"{e}); the checkpoint is damaged") from None
    if version != STATE_VERSION:
        raise LaunchError(f"SparseBalance state {path}: version {version}, this plugin reads "
                          f"version {STATE_VERSION}")
    if it != iteration:
        raise LaunchError(f"SparseBalance state {path} belongs to iteration {it}, the checkpoint "
                          f"is iteration {iteration}")
    return state
