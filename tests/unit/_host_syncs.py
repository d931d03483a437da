"""Host round trips of a piece of torch code, counted on CPU as a CUDA device would make them.

A host round trip is anything that makes the host wait for the device or move data between
them: a device value read back (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``, ``int(t)``,
``np.asarray(t)``, printing or formatting a tensor;
ops whose output size is data: ``nonzero``, ``masked_select``, boolean indexing, ``unique``,
``repeat_interleave`` without ``output_size``, ``bincount``; ``torch.equal``, ``allclose``), host
data made a tensor (``torch.tensor``, ``as_tensor``, ``from_numpy``: on a GPU an upload from
pageable memory, which waits for the stream), and explicit waits (``torch.cuda.synchronize``,
``Stream.synchronize``, ``Event.synchronize``).

``HostSyncCounter`` watches three levels, so that no path hides one:

- the Python calls (a ``TorchFunctionMode``): what the code calls, also where a CPU tensor never
  reaches the dispatcher (``.cpu()``, ``.tolist()`` and ``.numpy()`` read a CPU tensor
  directly, and would copy a CUDA one);
- the aten ops below them (a ``TorchDispatchMode``): the insides of composite ops, the C++
  autograd formulas that run in the backward, and the bodies of custom ops (both modes are
  re-entered around an op outside aten, whose Python body would otherwise run unwatched);
- ``torch.cuda``'s waits, patched to record (and to do nothing here).

A round trip seen at the Python level is not counted again for the aten ops it runs. A Triton
kernel launch waits for nothing: what the Triton interpreter does inside a launch (its copies
of the arguments) is left out. ``reads`` / ``writes`` / ``waits`` name the events in order
(Python names as called, ``aten.<op>`` below them); ``count`` is their sum.
"""

from __future__ import annotations

import sys

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

T = torch.Tensor
_READS = {T.item, T.tolist, T.cpu, T.numpy, T.__array__, T.__repr__, T.__format__,
          T.__bool__, T.__int__, T.__float__, T.__index__,
          T.nonzero, torch.nonzero, T.unique, torch.unique, torch.masked_select,
          T.masked_select, torch.bincount, T.bincount}
_WRITES = {torch.tensor, torch.as_tensor, torch.from_numpy}
# aten ops that read a device value back on every device (their result, or its size, is data)
_ATEN_READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2",
               "unique_dim", "unique_consecutive", "unique_dim_consecutive", "equal",
               "allclose", "is_nonzero", "bincount", "histc"}
_ATEN_WRITES = {"lift_fresh", "lift_fresh_copy"}       # host data becomes a tensor
_BOOL_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}
_QUIET_NAMESPACES = ("aten", "prim", "prims", "profiler")


def _bool_index(idx) -> bool:
    idx = idx if isinstance(idx, (tuple, list)) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx)


def _device_of(x):
    return x.device.type if isinstance(x, torch.Tensor) else None


class _State:
    def __init__(self):
        self.reads, self.writes, self.waits = [], [], []
        self.quiet = 0                      # > 0: inside a recorded call or a kernel launch

    def add(self, kind: str, name: str):
        if not self.quiet:
            getattr(self, kind).append(name)


class _Calls(TorchFunctionMode):
    def __init__(self, state):
        super().__init__()
        self.s = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind, name = self._classify(func, args, kwargs)
        if kind is None:
            return func(*args, **kwargs)
        self.s.add(kind, name)
        self.s.quiet += 1                   # the aten ops it runs are the same round trip
        try:
            return func(*args, **kwargs)
        finally:
            self.s.quiet -= 1

    @staticmethod
    def _classify(func, args, kwargs):
        name = getattr(func, "__name__", repr(func))
        if func in _READS:
            return "reads", name
        if func in _WRITES:
            return "writes", name
        if func in (T.to,) and any(str(a) == "cpu" for a in list(args[1:]) +
                                   list(kwargs.values())):
            return "reads", "to(cpu)"
        if func in (torch.repeat_interleave, T.repeat_interleave) \
                and isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"),
                               torch.Tensor) and kwargs.get("output_size") is None:
            return "reads", "repeat_interleave"
        if func in (T.__getitem__, T.__setitem__) and _bool_index(args[1]):
            return "reads", name + "[bool]"
        if name == "where" and len(args) == 1:
            return "reads", "where(cond)"
        return None, None


class _Ops(TorchDispatchMode):
    def __init__(self, state):
        super().__init__()
        self.s = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in _QUIET_NAMESPACES:
            opdef = _maybe_get_opdef(func)
            if opdef is not None:                          # a custom op: watch its body too
                with _Calls(self.s), _Ops(self.s):
                    return opdef._init_fn(*args, **kwargs)
        op = func.overloadpacket.__name__
        name = "aten." + op
        if op in _ATEN_READS:
            self.s.add("reads", name)
        elif op in _ATEN_WRITES:
            self.s.add("writes", name)
        elif op in _BOOL_INDEXED and len(args) > 1 and _bool_index(args[1]):
            self.s.add("reads", name + "[bool]")
        elif op == "repeat_interleave" and func._overloadname == "Tensor" \
                and kwargs.get("output_size") is None:
            self.s.add("reads", name)                      # repeats a tensor, no output size
        elif op == "tensor_split" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            self.s.add("reads", name)
        elif op in ("_to_copy", "copy_"):
            src = args[1] if op == "copy_" else args[0]
            dst = kwargs.get("device") if op == "_to_copy" else args[0].device
            src_t, dst_t = _device_of(src), torch.device(dst).type if dst is not None else None
            if dst_t is not None and src_t is not None and src_t != dst_t:
                self.s.add("reads" if dst_t == "cpu" else "writes", name)
        return func(*args, **kwargs)


class HostSyncCounter:
    """Counts host round trips (module docstring) inside ``with HostSyncCounter() as c:``."""

    def __init__(self):
        self._s = _State()
        self._undo = []

    reads = property(lambda self: self._s.reads)
    writes = property(lambda self: self._s.writes)
    waits = property(lambda self: self._s.waits)

    @property
    def count(self) -> int:
        return len(self.reads) + len(self.writes) + len(self.waits)

    def events(self) -> dict:
        return {"reads": list(self.reads), "writes": list(self.writes),
                "waits": list(self.waits)}

    def _patch(self, owner, attr, new):
        old = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, new)
        self._undo.append((owner, attr, old))

    def __enter__(self):
        s = self._s

        def wait(what):
            return lambda *a, **kw: s.add("waits", what)
        self._patch(torch.cuda, "synchronize", wait("cuda.synchronize"))
        self._patch(torch.cuda.Stream, "synchronize", wait("Stream.synchronize"))
        self._patch(torch.cuda.Event, "synchronize", wait("Event.synchronize"))
        interp = sys.modules.get("triton.runtime.interpreter")
        if interp is not None:                  # a launch: not a round trip
            run = interp.InterpretedFunction.run

            def launch(fn, *a, **kw):
                s.quiet += 1
                try:
                    return run(fn, *a, **kw)
                finally:
                    s.quiet -= 1
            self._patch(interp.InterpretedFunction, "run", launch)
        self._modes = (_Calls(s), _Ops(s))
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        for owner, attr, old in reversed(self._undo):
            setattr(owner, attr, old)
        self._undo.clear()
        return False


__all__ = ["HostSyncCounter"]
