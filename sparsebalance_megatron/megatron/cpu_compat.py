"""Run megatron-core (0.19.x) on a machine without CUDA: the one place with CPU shims.

megatron-core assumes CUDA in a few hundred places (allocations on ``torch.cuda.current_device()``,
CUDA RNG state, streams in DDP, a hard-coded ``device="cuda"`` in the schedules). On a CPU-only
machine, ``activate_cpu_shims()`` redirects exactly those to the CPU. It is idempotent and does
nothing at all when CUDA is available, so GPU runs never see it.

Shim id: ``sparsebalance.cpu_compat.v1``; targets megatron-core >=0.19,<0.20 and torch >= 2.6.
``check_shim_targets()`` fails loudly when a patched attribute disappears (a test calls it).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch.overrides import TorchFunctionMode

SHIM_ID = "sparsebalance.cpu_compat.v1"
_active = False
_mode: TorchFunctionMode | None = None
log = logging.getLogger(__name__)

# (module path, attribute) pairs the shims replace; checked by check_shim_targets().
_RANDOM_TARGETS = ("_get_cuda_rng_state", "_set_cuda_rng_state")
_CUDA_TARGETS = (
    "current_device", "current_stream", "default_stream", "stream", "Stream", "Event",
    "synchronize", "get_rng_state", "set_rng_state", "manual_seed",
    "empty_cache", "set_device",
)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Maps ``device="cuda"`` keyword arguments and ``.cuda()`` / ``.to("cuda")`` to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: every operation is already ordered on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _NullEvent:
    """Stands in for ``torch.cuda.Event``; timing on CPU goes through wall clock instead."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cpu_device(*args, **kwargs):
    return torch.device("cpu")


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU version of megatron's clip_grad_by_total_norm_fp32 (which asserts CUDA tensors)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if isinstance(clip_coeff, torch.Tensor):
        clip_coeff = clip_coeff.clamp_max(1.0)
        torch._foreach_mul_(grads, clip_coeff)
    elif clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def check_shim_targets() -> list[str]:
    """Names the shims patch that are missing from the installed torch / megatron-core."""
    import megatron.core.optimizer.optimizer as moptimizer
    import megatron.core.tensor_parallel.random as mrandom

    missing = [f"megatron.core.tensor_parallel.random.{n}" for n in _RANDOM_TARGETS
               if not hasattr(mrandom, n)]
    if not hasattr(moptimizer, "clip_grad_by_total_norm_fp32"):
        missing.append("megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32")
    missing += [f"torch.cuda.{n}" for n in _CUDA_TARGETS if not hasattr(torch.cuda, n)]
    return missing


def activate_cpu_shims() -> bool:
    """Install the CPU shims when CUDA is absent. Returns True when they are (now) active."""
    global _active, _mode
    if torch.cuda.is_available():
        return False
    if _active:
        return True
    missing = check_shim_targets()
    if missing:
        raise RuntimeError(f"{SHIM_ID}: shim targets missing (megatron-core/torch changed): {missing}")

    import megatron.core.optimizer.optimizer as moptimizer
    import megatron.core.tensor_parallel.random as mrandom

    moptimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_cpu
    try:  # megatron.training (the entry's argument validation) asks for the GPU architecture
        import megatron.training.arguments as margs
        margs.get_device_arch_version = lambda *a, **k: 0
    except ImportError:
        pass
    # Megatron asks tensor-parallel GPU runs to serialise kernel launches; meaningless on CPU.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    cuda = torch.cuda
    cuda.current_device = _cpu_device
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.set_device = lambda *a, **k: None
    # The "CUDA" RNG state becomes the CPU generator's: Megatron's tracker forks it for
    # tensor-parallel initialisation and dropout, deterministically per seed.
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all, so seed the generator directly.)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    _mode = _CudaToCpuMode()
    _mode.__enter__()  # global for the process: megatron builds "cuda" tensors anywhere
    _active = True
    log.info("%s active: megatron-core runs on CPU (gloo)", SHIM_ID)
    return True


def shims_active() -> bool:
    return _active


def device() -> torch.device:
    """The device model tensors live on: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
