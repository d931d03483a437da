"""The one place where megatron-core's own functions are replaced: CPU shims and a wheel fix.

1. ``activate_cpu_shims()`` (id ``sparsebalance.cpu_compat.v2``): megatron-core assumes CUDA in a
   few hundred places (allocations on ``torch.cuda.current_device()``, CUDA RNG state, streams in
   DDP, a hard-coded ``device="cuda"`` in the schedules, ``initialize_megatron``'s CUDA assertion,
   model-parallel set-up skipped when ``torch.cuda.device_count() == 0``). On a CPU-only machine it
   redirects exactly those to the CPU, makes the checkpoint writers' results queue in the
   ``fork`` context (Megatron spawns it at the first save, which re-imports the training script)
   and skips ``pretrain()``'s JIT warm-up (an inductor build per rank, ``_skip_jit_warmup``).
   Idempotent; does nothing at all when CUDA is available, so GPU runs never see it.
2. ``skip_prebuilt_helpers_compile()`` (id ``sparsebalance.wheel_helpers.v1``), on any device:
   ``pretrain()`` runs ``make`` in ``megatron/core/datasets`` to build the dataset helpers, but the
   megatron-core wheel ships them prebuilt and without a Makefile, so ``make`` fails and the run
   exits. When the prebuilt extension imports and there is no Makefile, the compile step becomes a
   no-op; a Megatron-LM checkout (which has the Makefile) keeps its own behaviour.

Both target megatron-core >=0.19.2,<0.21 (0.19.2 and 0.20.0 tested: ``TESTED_MEGATRON_CORE``; the
launch warns once on another version) and torch >= 2.6; ``check_shim_targets()`` fails loudly
when a replaced attribute disappears (a test calls it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch
from torch.overrides import TorchFunctionMode

SHIM_ID = "sparsebalance.cpu_compat.v2"
WHEEL_SHIM_ID = "sparsebalance.wheel_helpers.v1"
_active = False
_mode: TorchFunctionMode | None = None
log = logging.getLogger(__name__)

# (module path, attribute) pairs the shims replace; checked by check_shim_targets().
_RANDOM_TARGETS = ("_get_cuda_rng_state", "_set_cuda_rng_state")
_CUDA_TARGETS = (
    "current_device", "current_stream", "default_stream", "stream", "Stream", "Event",
    "synchronize", "get_rng_state", "set_rng_state", "manual_seed",
    "empty_cache", "set_device", "device_count", "is_current_stream_capturing",
)
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


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
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's mixed-precision optimizers accept parameters by their CUDA type name
            # ('torch.cuda.HalfTensor'): report CPU tensors as the CUDA type they stand for.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
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


class _DropRngWarning(logging.Filter):
    """On CPU the "CUDA" RNG *is* the CPU generator, so Megatron's tracker sees the CPU state
    change inside every fork and warns each time: expected here, and only noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _RNG_WARNING not in record.getMessage()


def _skip_jit_warmup(*args, **kwargs) -> None:
    """Replaces Megatron's ``_warmup_jit_function`` on the CPU. The warm-up runs the fused bias
    kernels (``jit_fuser``: ``torch.compile``) on random tensors so that their compile is paid
    before step 1; on the CPU that is an inductor C++ build in every rank of every launch (about
    3 s of CPU and ten helper processes each, warm compile cache) for kernels the run compiles at
    first use anyway when its model has them (bias-free models never do)."""


def check_shim_targets() -> list[str]:
    """Names the shims replace that are missing from the installed torch / megatron-core."""
    import megatron.core.datasets.utils as mdutils
    import megatron.core.optimizer.optimizer as moptimizer
    import megatron.core.tensor_parallel.random as mrandom

    missing = [f"megatron.core.tensor_parallel.random.{n}" for n in _RANDOM_TARGETS
               if not hasattr(mrandom, n)]
    if not hasattr(moptimizer, "clip_grad_by_total_norm_fp32"):
        missing.append("megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32")
    if not hasattr(mdutils, "compile_helpers"):
        missing.append("megatron.core.datasets.utils.compile_helpers")
    try:
        import megatron.training.initialize as minit
        import megatron.training.training as mtraining
        if not hasattr(mtraining, "initialize_megatron"):
            missing.append("megatron.training.training.initialize_megatron")
        if not hasattr(minit, "_warmup_jit_function"):
            missing.append("megatron.training.initialize._warmup_jit_function")
    except ImportError:
        pass  # megatron.training is optional for the model-only uses of the shims
    missing += [f"torch.cuda.{n}" for n in _CUDA_TARGETS if not hasattr(torch.cuda, n)]
    return missing


def skip_prebuilt_helpers_compile() -> bool:
    """Make ``pretrain()``'s dataset-helper compile a no-op where the wheel ships them prebuilt.

    Returns True when the compile step was replaced (idempotent)."""
    import megatron.core.datasets.utils as mdutils

    if getattr(mdutils.compile_helpers, "_sparsebalance", False):
        return True
    if os.path.exists(os.path.join(os.path.dirname(mdutils.__file__), "Makefile")):
        return False  # a source checkout: Megatron builds its helpers itself
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False  # nothing prebuilt: let Megatron report its own error

    def compile_helpers():
        """Prebuilt in the megatron-core wheel (see sparsebalance_megatron.megatron.launch.compat)."""

    compile_helpers._sparsebalance = True
    mdutils.compile_helpers = compile_helpers
    log.debug("%s: megatron-core's prebuilt dataset helpers are used as they are", WHEEL_SHIM_ID)
    return True


# the forked Manager behind Megatron's checkpoint results queue, held here: a Manager that is
# garbage-collected shuts its server down and the queue with it
_results_manager = None


def _die_with(parent: int) -> None:
    """In the forked Manager server: default SIGTERM, and SIGKILL when the rank that forked it
    ends, however it ends (``os._exit`` runs no finaliser; torchrun signals only live ranks):
    an orphaned server would hold the job's output open."""
    import signal

    from ..runtime.children import die_with_parent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent)


def _fork_checkpoint_results_queue() -> None:
    """A ``torch_dist`` save collects its writers' results through one multiprocessing Manager
    queue per process (``filesystem_async._results_queue``), made at the first save in the
    ``spawn`` context: the spawned server imports the training script, torch and megatron
    again, which on a 2-core machine costs every rank 5-10 s at its first save (most of a test
    run's save). Made here in the ``fork`` context, as Megatron makes it for its async saves
    (``training/async_utils.py``), it starts at once; here, at argument parsing, no process
    group or thread of ours exists yet, and the server dies with its rank (``_die_with``).
    Only a saving speed: a megatron-core without that queue keeps its own."""
    global _results_manager
    import multiprocessing
    from multiprocessing.managers import SyncManager

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", "absent") is not None:
        return                                  # made already, or not how this version works
    _results_manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    _results_manager.start(initializer=_die_with, initargs=(os.getpid(),))
    filesystem_async._results_queue = _results_manager.Queue()


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
    try:  # pretrain() asserts CUDA unless initialize_megatron is told a CPU run is meant
        import megatron.training.training as mtraining
        mtraining.initialize_megatron = functools.partial(mtraining.initialize_megatron,
                                                          allow_no_cuda=True)
    except ImportError:
        pass
    try:  # pretrain()'s JIT warm-up: see _skip_jit_warmup
        import megatron.training.initialize as minit
        minit._warmup_jit_function = _skip_jit_warmup
    except ImportError:
        pass
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
    # Megatron-LM dev's pipeline send/receive asks whether a CUDA graph is being captured (a
    # query the CUDA runtime answers only with a driver): never, on the CPU.
    cuda.is_current_stream_capturing = lambda *a, **k: False
    # One "device": Megatron skips model-parallel set-up and RNG seeding when it counts none.
    cuda.device_count = lambda *a, **k: 1
    # The "CUDA" RNG state becomes the CPU generator's: Megatron's tracker forks it for
    # tensor-parallel initialisation and dropout, deterministically per seed.
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all, so seed the generator directly.)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropRngWarning())
    _fork_checkpoint_results_queue()

    _mode = _CudaToCpuMode()
    _mode.__enter__()  # global for the process: megatron builds "cuda" tensors anywhere
    _active = True
    from ..runtime.comm import say
    say(f"no CUDA: megatron-core runs on the CPU ({SHIM_ID})")
    return True


# megatron-core versions the test suite has passed on (README "Install next to Megatron" gives
# the commands; setup.py declares this range). 0.20.0 is Megatron-LM main at d98e8a64dd,
# installed from the checkout (it is not on PyPI yet).
TESTED_MEGATRON_CORE = ("0.19.2", "0.20.0")
_warned_versions = False


def untested_versions_warning(installed: str | None = None) -> str | None:
    """A one-line warning when the installed megatron-core is not one the tests ran on."""
    if installed is None:
        import megatron.core
        installed = megatron.core.__version__
    release = str(installed).split("+")[0]          # a source checkout adds "+<commit>"
    if release in TESTED_MEGATRON_CORE:
        return None
    return (f"warning: megatron-core {installed} is installed; sparsebalance_megatron was "
            f"tested with megatron-core {' and '.join(TESTED_MEGATRON_CORE)} (setup.py: "
            f"megatron-core>={TESTED_MEGATRON_CORE[0]},<{_next_minor(TESTED_MEGATRON_CORE[-1])})")


def _next_minor(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}"


def warn_untested_versions() -> None:
    """Say ``untested_versions_warning`` once per process, from rank 0."""
    global _warned_versions
    if _warned_versions:
        return
    _warned_versions = True
    msg = untested_versions_warning()
    if msg:
        from ..runtime.comm import say
        say(msg)


def device() -> torch.device:
    """The device model tensors live on: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
