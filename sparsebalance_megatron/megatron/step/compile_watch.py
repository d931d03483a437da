"""Triton kernel compiles counted per step: which steps paid a JIT compile, and how long it took.

The ``triton`` backend compiles one kernel per specialisation: launch config, dtype, the
constexprs of the selection and list kernels (``block_lists``: the kept-slot and list widths,
rounded up to powers of two, follow each micro-batch's longest document and selection width)
and the divisibility of the integer arguments it does not exempt. With variable-length
micro-batches a new power of two can first appear many steps into a run; that step then pays
a compile (a fraction of a second on an H100), a cost that a long run amortises and a
ten-step benchmark does not. The post-wrap hook compiles every width of the fused selection
at start-up (``model/selection_warmup.py``), so a count here after the first step is a kernel
that warm-up missed. ``CompileWatch`` counts the compiles (and loads from triton's disk
cache into this process) through triton's JIT hooks, ``knobs.runtime.jit_cache_hook`` (before)
and ``jit_post_compile_hook`` (after), chained with any hooks already set. ``take()`` returns
and clears the count and seconds since the last call: the step record's ``kernel_compiles``
and ``kernel_compile_s``, this rank's (the rest of the record is the same on every rank). The
seconds are summed over compiles: the start-up warm-up compiles in parallel, so the first
step's figure can be many times the wall time it took (run 5: 74 s summed, 2.9 s of wall).
Where triton or its hooks are missing, nothing is counted (``available`` False). What goes
through ``triton.jit`` is counted (the ``triton`` backend, the selection and list kernels);
torch inductor's compiles (``flex``) take another path and are not.
Pure python; must not import megatron or torch.distributed.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Tuple


class CompileWatch:
    """Counts Triton JIT compiles in this process once ``install``-ed (module docstring)."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self.available = False
        self._started: dict = {}
        self._lock = threading.Lock()
        self._knobs = None
        self._prev: Tuple[Optional[object], Optional[object]] = (None, None)

    def install(self) -> bool:
        """Chain this watch into triton's JIT hooks; False where triton has none."""
        try:
            from triton import knobs
            runtime = knobs.runtime
            prev = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        except (ImportError, AttributeError):
            return False
        self._knobs, self._prev = runtime, prev
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after
        self.available = True
        return True

    def uninstall(self) -> None:
        """Put back the hooks ``install`` found (tests; a run keeps its watch)."""
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._prev
            self._knobs, self.available = None, False

    def _before(self, **kw):
        with self._lock:               # a manual warmup compiles too: counted the same
            self._started[(threading.get_ident(), kw.get("key"))] = time.perf_counter()
        prev = self._prev[0]
        return prev(**kw) if prev is not None else None

    def _after(self, **kw):
        with self._lock:
            start = self._started.pop((threading.get_ident(), kw.get("key")), None)
            if start is not None:
                self.count += 1
                self.seconds += time.perf_counter() - start
        prev = self._prev[1]
        return prev(**kw) if prev is not None else None

    def take(self) -> Tuple[int, float]:
        """(compiles, seconds) since the last ``take``, and start counting again."""
        with self._lock:
            out = (self.count, self.seconds)
            self.count, self.seconds = 0, 0.0
        return out


WATCH = CompileWatch()
"""The process's watch (``StepReporter`` installs it when the run has sparse attention)."""
