"""The one module of ours that talks to torch.distributed: small gathers and broadcasts, and the
context-parallel collectives of the sparse attention.

Used by the callback's control plane (``step/exchange.py``: each step's records gathered as
fixed-size tensors over Megatron's groups; DST's rounds all-reduced over a gloo copy of the DP
group, ``step/agreement.py``, so every TP, PP, CP and DP rank holds identical budgets), the
profiler, the console lines, and
``context_parallel`` (all-to-all of q/k/v and outputs, the all-reduce of block shares).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def init_process_group(backend: str, world_size: int, rank: int, timeout) -> None:
    """Join the job's process group (idempotent)."""
    if not is_initialized():
        dist.init_process_group(backend=backend, world_size=world_size, rank=rank, timeout=timeout)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def destroy_process_groups() -> None:
    """Every rank done: a barrier, then every process group destroyed (nothing without one)."""
    if is_initialized():
        dist.barrier()
        dist.destroy_process_group()


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


def say_rank(msg: str) -> None:
    """One ``[sparsebalance]`` line on the console from this rank: what happened to it alone (a
    helper process of its own that died, say)."""
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


# --- fixed-size tensors over a process group (the per-step control plane) --------------------

def _device(group) -> torch.device:
    """Where ``group``'s collectives take tensors: the current GPU for NCCL, else the host."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_tensor(x: torch.Tensor, group) -> torch.Tensor:
    """``[n, *x.shape]`` on the host: every rank's ``x`` in ``group``'s rank order (every rank
    passes the same shape and dtype; ``n`` = the group's size; None or no process group: this
    rank's alone)."""
    n = group_size(group)
    if n == 1:
        return x.detach().reshape(1, *x.shape).clone()
    dev = _device(group)
    src = x.detach().to(dev).contiguous().reshape(-1)
    out = torch.empty(n * src.numel(), dtype=src.dtype, device=dev)
    # all_gather_single (torch 2.13) is all_gather_into_tensor renamed
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, src, group=group)
    return out.reshape(n, *x.shape).cpu()


def all_reduce_tensor(x: torch.Tensor, group, op: str) -> torch.Tensor:
    """``x`` summed (``op`` "sum") or maximised ("max") element-wise over ``group``, on the host
    (every rank passes the same shape and dtype; None or a group of one: ``x``)."""
    if group_size(group) == 1:
        return x
    buf = x.detach().to(_device(group)).contiguous()
    dist.all_reduce(buf, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op],
                    group=group)
    return buf.cpu()


def broadcast_tensor(x: torch.Tensor, group, group_src: int = 0) -> torch.Tensor:
    """Rank ``group_src``'s ``x`` (a rank of ``group``, by its rank there) on every rank of
    ``group``, on the host; the others pass a tensor of the same shape and dtype to fill."""
    if group_size(group) == 1:
        return x
    dev = _device(group)
    buf = x.detach().to(dev).contiguous()
    dist.broadcast(buf, src=dist.get_global_rank(group, group_src), group=group)
    return buf.cpu()



# --- waiting for one rank's long work (the start-up latency profile) ---------------------------

def new_gloo_group(timeout):
    """A gloo group of every rank whose collectives time out after ``timeout`` (a timedelta),
    not after the job's ``--distributed-timeout-minutes`` (collective: every rank calls it)."""
    return dist.new_group(backend="gloo", timeout=timeout)


def new_group(ranks, backend: Optional[str] = None) -> object:
    """A group of the global ``ranks`` on ``backend`` (None: the default; collective: every rank
    of the job calls it, for every group, in the same order)."""
    return dist.new_group(sorted(int(r) for r in ranks), backend=backend)


def gloo_copy(group) -> object:
    """A gloo group of ``group``'s ranks, for collectives a thread makes beside the training
    thread's (which keep ``group``): collective over the job, every rank's group copied in the
    same order on every rank. None where every such group has one rank (or no process group)."""
    if not is_initialized():
        return None
    mine = tuple(dist.get_process_group_ranks(group)) if group is not None else (rank(),)
    every = sorted({tuple(g) for g in all_gather_object(mine)})
    if all(len(g) == 1 for g in every):
        return None
    out = None
    for ranks in every:
        made = new_group(ranks, backend="gloo")
        if ranks == mine:
            out = made
    return out


def destroy_group(group) -> None:
    dist.destroy_process_group(group)


def broadcast_bytes(payload: Optional[bytes], status: int, *, group, on_wait=None,
                    poll_s: float = 1.0) -> tuple[int, bytes]:
    """(status, payload) of rank 0 on every rank of ``group``. Rank 0 passes them; the others
    pass None and wait without blocking in the collective: they poll it every ``poll_s``
    seconds and call ``on_wait()`` in between (progress lines), so how long they wait is
    ``group``'s timeout, not the job's."""
    import time

    head = torch.zeros(2, dtype=torch.int64)
    if dist.get_rank() == 0:
        head[0], head[1] = status, len(payload or b"")
    work = dist.broadcast(head, src=0, group=group, async_op=True)
    while not work.is_completed():
        if on_wait is not None:
            on_wait()
        time.sleep(poll_s)
    work.wait()
    status, n = int(head[0]), int(head[1])
    buf = torch.empty(n, dtype=torch.uint8)
    if dist.get_rank() == 0:
        buf = torch.frombuffer(bytearray(payload or b""), dtype=torch.uint8) if n else buf
    if n:
        dist.broadcast(buf, src=0, group=group)
    return status, bytes(buf.numpy().tobytes())


# --- process groups (context parallelism) -----------------------------------------------------

def group_size(group) -> int:
    """Ranks in ``group`` (1 for None or without a process group)."""
    return dist.get_world_size(group) if group is not None and is_initialized() else 1


def group_rank(group) -> int:
    """This process's rank in ``group`` (0 for None or without a process group)."""
    return dist.get_rank(group) if group is not None and is_initialized() else 0


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its gradient is the same all-to-all of the output's
    gradient (``torch.distributed.nn``'s version is deprecated in torch 2.13)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad.contiguous(), ctx.group), None


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``x [n, ...]`` with ``n`` = the group's size: slice ``i`` goes to rank ``i``; returns the
    slices received, in rank order. Differentiable: the backward is the reverse all-to-all (gloo
    and NCCL both have ``all_to_all_single``)."""
    return _AllToAll.apply(x.contiguous(), group)


def all_reduce_sum_(x: torch.Tensor, group) -> torch.Tensor:
    """In-place sum of ``x`` over ``group`` (not differentiated)."""
    dist.all_reduce(x, group=group)
    return x


def job_store(timeout_s: float = 10.0):
    """The job's key-value store: the process group's once it exists; before it, torchrun's
    agent store (``TORCHELASTIC_USE_AGENT_STORE``: torchrun hosts it at ``MASTER_ADDR:
    MASTER_PORT`` before any rank starts), a client connected within ``timeout_s``; else None
    (another launcher: rank 0 hosts the store once the process group starts)."""
    import os
    from datetime import timedelta

    if is_initialized():
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=timeout_s))


def watchdog_store():
    """The job's key-value store (torchrun's, or the one ``init_process_group`` made) under the
    prefix ``sparsebalance/watchdog/<torchrun's restart count>/`` (torchrun keeps its store
    across restarts): each rank's heartbeat record, for ``runtime/watchdog.py``."""
    import os

    from torch.distributed.distributed_c10d import _get_default_store

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"sparsebalance/watchdog/{attempt}/", _get_default_store())
