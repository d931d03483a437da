"""A GPU attention backend that fails falls back to the next one ``auto`` would pick.

``--sb-attention-backend auto`` runs fa4 where FlashAttention-4 is installed, else triton, else
flex (``attention.api``; the latency table's profile may order them otherwise). A CuTe DSL compile
that fails on a shape it has not met, or a kernel that raises, ended the job. Here every sparse
attention call goes through ``BackendFallback.run``: where the backend ``auto`` chose raises,
the next backend of ``CHAIN`` that can run here takes over, for this call and for the rest of the
run (``BudgetContext.set_backend`` and ``attention.api.set_auto_backend``: every layer, every
later call), once per backend, with one warning line naming the backend, the shape and the
error. The first call of each shape key (heads, head dim, dtype, block) in a training forward
also runs the backward once on detached copies (``probe``), so that a backward kernel that fails
to compile (FA4 compiles its backward at the first backward) falls back at the forward too,
before anything of the step depends on it.

What is not fallen back from: an error that leaves the device unusable (a CUDA error: an illegal
memory access, a device-side assert, a launch failure; after any other failure the device is
synchronised and an error it then reports counts too) ends the job with a note naming the backend
and the shape; out of memory ends it too (another kernel would not fit better); an explicit
``--sb-attention-backend`` (not ``auto``) is the user's choice and fails as it is; the last
backend of the chain has nothing to fall back to.

The rest of the run follows the backend that runs now (``step/fallback_sync.py``): every rank
reports the backend it runs in the step's gather, and all adopt the furthest one down the chain
(so the ranks' latency models agree), the latency model is re-priced for it and the metrics name
the fallback. Part of the megatron adapter (model room); no torch.distributed here.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch

CHAIN = ("fa4", "triton", "flex")
"""The order ``auto`` prefers the GPU backends in (fa4 where installed; ``LENGTH_FREE_BACKENDS``
then flex, ``AUTO_UNMEASURED``): a failing one falls back to the next that can run."""
CUDA_ERRORS = ("CUDA error", "illegal memory access", "device-side assert",
               "unspecified launch failure", "misaligned address", "an illegal instruction",
               "CUBLAS_STATUS_EXECUTION_FAILED", "CUDNN_STATUS_EXECUTION_FAILED")


def corrupts_device(err: BaseException) -> bool:
    """Whether ``err`` is an error after which the device's state cannot be trusted."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(err, accel):
        return True
    text = str(err)
    return any(m in text for m in CUDA_ERRORS)


def describe_shape(q: torch.Tensor, k: torch.Tensor, documents: Optional[int] = None) -> str:
    """``q [t, h, d] / k [t, g, d] bfloat16, 3 documents``: what a kernel was called on."""
    text = (f"q {list(q.shape)} / k {list(k.shape)} {str(q.dtype).replace('torch.', '')}")
    return text + (f", {documents} document(s)" if documents is not None else "")


class BackendFallback:
    """This run's fallbacks (one per ``BudgetContext``): the events, and the backends tried.
    ``missing(backend, q)``: why ``backend`` cannot run for ``q`` (None: it can), by default
    ``attention.api.backend_missing``; ``say``: where the warning goes (stderr)."""

    def __init__(self, *, missing: Optional[Callable] = None, say: Optional[Callable] = None,
                 stand_in: Optional[Callable[[str], str]] = None):
        self.events: list[dict] = []       # {"from", "to", "shape", "error"}, in order
        self._failed: set = set()
        self._probed: set = set()
        self._missing, self._say, self.stand_in = missing, say, stand_in
        self.followed: Optional[str] = None   # the kernel every rank follows (fallback_sync)

    def current(self, budget) -> Optional[str]:
        """The backend a fallback put in place (None: none happened)."""
        return self.events[-1]["to"] if self.events else None

    def run(self, budget, configured: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            call: Callable, *, block_size: int, documents: Optional[int] = None,
            probe: bool = True):
        """``call(backend, q, k, v)``'s result for the backend the layers run (``budget``'s,
        else ``configured``), falling back along ``CHAIN`` where it fails (``configured``
        'auto' only). ``probe``: the backward may be run once per shape key (False where the
        call holds a collective, context parallelism)."""
        from ...attention.api import resolve_backend

        backend = budget.attention_backend or configured
        running = resolve_backend(backend, q.device)
        if configured != "auto" or running not in CHAIN:
            return call(backend, q, k, v)
        while True:
            try:
                kernel = self.stand_in(running) if self.stand_in is not None else running
                if probe:
                    self._probe(kernel, q, k, v, block_size, call)
                return call(kernel, q, k, v)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:                  # noqa: BLE001 - judged below
                running = self._fall_back(budget, running, q, k, e, block_size, documents)

    def _probe(self, backend: str, q, k, v, block_size: int, call) -> None:
        """Once per (backend, shape key), in a training forward: the call and its backward on
        detached copies, so that a backward kernel that cannot compile fails here, where the
        forward falls back, and not in the step's backward, where nothing can."""
        key = (backend, tuple(q.shape[1:]), tuple(k.shape[1:]), q.dtype, block_size)
        if key in self._probed or not (torch.is_grad_enabled() and q.requires_grad) \
                or _in_backward():       # activation recomputation: probed at a plain forward
            return
        self._probed.add(key)
        qd, kd, vd = (x.detach().requires_grad_() for x in (q, k, v))
        out, _ = call(backend, qd, kd, vd)
        out.float().sum().backward()

    def _fall_back(self, budget, failed: str, q, k, err: Exception, block_size: int,
                   documents: Optional[int]) -> str:
        """The backend to run instead of ``failed`` after ``err``, said once; re-raises where
        there is none or the device cannot be trusted."""
        shape = describe_shape(q, k, documents)
        if not corrupts_device(err) and q.is_cuda:
            try:
                torch.cuda.synchronize(q.device)
            except Exception as sync_err:           # noqa: BLE001 - an asynchronous error
                err = sync_err
        if corrupts_device(err):
            err.add_note(f"[sparsebalance] the {failed} attention kernel failed on {shape} with "
                         f"an error that leaves the device's state unusable: the job ends here "
                         f"(no fallback to another kernel)")
            raise err
        self._failed.add(failed)
        nxt = self._next(failed, q, block_size)
        if nxt is None:
            err.add_note(f"[sparsebalance] the {failed} attention kernel failed on {shape}; no "
                         f"other kernel of {', '.join(CHAIN)} can run here: the job ends")
            raise err
        why = (str(err).strip().splitlines() or [""])[0][:200]
        self.events.append({"from": failed, "to": nxt, "shape": shape,
                            "error": f"{type(err).__name__}: {why}"})
        budget.set_backend(nxt)
        from ...attention.api import set_auto_backend
        set_auto_backend(nxt, f"the fallback after {failed} failed", device=q.device)
        (self._say or _stderr)(f"[sparsebalance] warning: the {failed} attention kernel failed on "
                               f"{shape} ({type(err).__name__}: {why}); falling back to {nxt}, "
                               f"the next kernel auto picks, for the rest of the run (every "
                               f"rank from the next step; the latency model re-priced for it)")
        return nxt

    def _next(self, failed: str, q, block_size: int) -> Optional[str]:
        from ...attention.api import backend_missing

        missing = self._missing or (lambda b, x: backend_missing(
            b, x.device, dtype=x.dtype, head_dim=x.shape[-1], block_size=block_size))
        for b in CHAIN[CHAIN.index(failed) + 1:]:
            if b not in self._failed and missing(b, q) is None:
                return b
        return None


def _in_backward() -> bool:
    """Whether this runs inside a backward pass (activation recomputation's forward)."""
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:
        return False


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


STAND_INS = {"fa4-fails": "fa4", "triton-fails": "triton"}


def stand_in_for_faults(budget, fault_specs, rank: int) -> Optional[str]:
    """--sb-fault RANK:STEP:fa4-fails / triton-fails (tests, CPU): the run's kernels stand in for
    the GPU ones. ``auto``'s pick becomes fa4, and fa4, triton and flex each compute with the
    torch kernel under their own name; the named kernel raises on global rank RANK from
    iteration STEP on (as a compile failure on a shape it has not met). Returns the line that
    says so (None without such a fault)."""
    faults = [(r, s, STAND_INS[k]) for r, s, k in fault_specs or () if k in STAND_INS]
    if not faults:
        return None

    def compute(backend: str) -> str:
        step = getattr(budget.plan, "step", None)
        for r, s, kernel in faults:
            if kernel == backend and r == rank and step is not None and step + 1 >= s:
                raise RuntimeError(f"--sb-fault: injected compile failure of the {kernel} kernel "
                                   f"on a new shape (rank {r}, iteration {step + 1})")
        return "torch"

    budget.set_backend(CHAIN[0])
    budget.fallback = BackendFallback(missing=lambda b, q: None, stand_in=compute)
    return (f"--sb-fault: the attention kernels stand in for {', '.join(CHAIN)} (the torch "
            f"kernel under each name; auto's pick {CHAIN[0]}); injected: "
            + ", ".join(f"{k} fails on rank {r} from iteration {s}" for r, s, k in faults))
