"""The one module of ours that talks to torch.distributed: small gathers and broadcasts.

Used by the callback (gathering per-micro-batch timings, broadcasting the DST plan so every TP,
PP and DP rank holds identical budgets), the profiler and the console lines.
"""

from __future__ import annotations

import torch.distributed as dist


def init_process_group(backend: str, world_size: int, rank: int, timeout) -> None:
    """Join the job's process group (idempotent)."""
    if not is_initialized():
        dist.init_process_group(backend=backend, world_size=world_size, rank=rank, timeout=timeout)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def launch_rank() -> int:
    """This process's global rank, also before the process group exists (torchrun's RANK)."""
    import os

    return rank() if is_initialized() else int(os.environ.get("RANK", "0"))


def say(msg: str) -> None:
    """One ``[sparsebalance]`` line on the console, from global rank 0 (also before the process
    group exists)."""
    if launch_rank() == 0:
        print(f"[sparsebalance] {msg}", flush=True)


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def all_gather_object(obj) -> list:
    """Every rank's ``obj`` in rank order (small, picklable payloads only: timings, stats)."""
    if not is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank."""
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]

