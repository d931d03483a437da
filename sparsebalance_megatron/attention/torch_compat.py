"""The torch APIs of the GPU paths whose signatures differ between releases, inspected at run time
here and nowhere else. The GPU machine has torch 2.11, the CPU install 2.13 (docs/GPU.md).

- ``varlen_attention``: ``torch.nn.attention.varlen.varlen_attn`` with GQA. 2.13 takes
  ``enable_gqa``; 2.11 does not (a ``TypeError`` if passed) and hands K/V with fewer heads
  straight to FlashAttention-2's varlen kernel, which shares each K/V head among its query heads
  when the query heads are a multiple of the K/V heads ("native"). A release whose kernel refuses
  that gets K/V repeated to the query heads ("repeat"), decided once per ``varlen_attn``.
- ``CHECKS`` / ``signature_problems()``: every torch call of a GPU path with the keywords it
  passes. ``gpu_check.py --steps env`` (the device's first call) and ``make device-stack`` (the
  device's torch on CPU) list what this torch lacks before anything is timed.

Pure torch; must not import megatron or torch.distributed.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Dict, List, Optional, Tuple

import torch

# (where, the keywords passed: a tuple inside is "one of these", who calls it)
CHECKS: Tuple[Tuple[str, tuple, str], ...] = (
    ("torch.nn.attention.varlen:varlen_attn", ("scale", ("window_size", "is_causal")),
     "dense.py varlen (enable_gqa optional: varlen_attention)"),
    ("torch.nn.attention.flex_attention:flex_attention",
     ("block_mask", "scale", "enable_gqa", "kernel_options"), "flex.py"),
    ("torch.nn.attention.flex_attention:BlockMask.__init__",
     ("seq_lengths", "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
      "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices", "BLOCK_SIZE",
      "mask_mod"), "flex.py build_block_mask"),
    ("torch.nn.attention:sdpa_kernel", ("set_priority",), "dense.py sdpa"),
    ("torch.nn.functional:scaled_dot_product_attention", ("is_causal", "scale", "enable_gqa"),
     "dense.py loop and sdpa, kernels.py"),
    ("torch.library:custom_op", ("mutates_args",), "sparse_triton.py, fa4_cute.py"),
    ("torch._library.custom_ops:CustomOpDef.register_autograd", ("setup_context",),
     "sparse_triton.py, fa4_cute.py"),
    ("torch._library.custom_ops:CustomOpDef.register_fake", (), "sparse_triton.py, fa4_cute.py"),
    ("torch._dynamo:maybe_mark_dynamic", (), "flex.py"),
    ("torch:compile", ("backend", "mode"), "flex.py"),
    ("torch.cuda:set_sync_debug_mode", (), "gpu_check.py recompile"),
    ("torch:repeat_interleave", ("output_size",), "dense.py, blocks.py"),
)


def _lookup(where: str):
    module, _, attr = where.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def parameter_names(fn) -> Optional[frozenset]:
    """The names ``fn`` accepts (None: it takes ``**kwargs``, so any). A builtin without an
    inspectable signature is read from its docstring's first ``name(...)`` line."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        doc = (getattr(fn, "__doc__", None) or "").strip()
        m = re.search(r"\w+\(([^)]*)\)", doc)
        if m is None:
            raise ValueError(f"{fn!r}: no signature and no 'name(...)' line in its docstring")
        return frozenset(re.findall(r"(\w+)\s*(?:=|,|$)", m.group(1)))
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


def signature_problems(checks=CHECKS) -> List[str]:
    """One line per missing API or keyword of ``checks``; empty when this torch has them all."""
    out = []
    for where, keywords, user in checks:
        try:
            names = parameter_names(_lookup(where))
        except (ImportError, AttributeError, ValueError) as e:
            out.append(f"{where} ({user}): {type(e).__name__}: {e}")
            continue
        if names is None:
            continue
        for kw in keywords:
            alts = kw if isinstance(kw, tuple) else (kw,)
            if not any(a in names for a in alts):
                out.append(f"{where} ({user}): no keyword {' or '.join(alts)} in torch "
                           f"{torch.__version__}")
    return out


# per varlen_attn function object: "enable_gqa", "native" or "repeat", and why
_VARLEN_MODE: Dict[object, Tuple[str, str]] = {}


def varlen_gqa_mode(fn=None) -> Tuple[str, str]:
    """(how GQA reaches ``fn`` (default: torch's ``varlen_attn``), why). Before the first GQA
    call of a release without ``enable_gqa`` this is ``native``, to be confirmed by that call."""
    fn = fn if fn is not None else _varlen_fn()
    if fn not in _VARLEN_MODE:
        names = parameter_names(fn)
        if names is None or "enable_gqa" in names:
            return "enable_gqa", "varlen_attn takes enable_gqa"
        return "native", (f"torch {torch.__version__}'s varlen_attn has no enable_gqa: K/V go "
                          f"to the kernel with their own heads")
    return _VARLEN_MODE[fn]


def _varlen_fn():
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn


def varlen_attention(q, k, v, cu: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """Causal ``varlen_attn`` over packed documents (q ``[t, np, hn]``, k/v ``[t, ng, hn]``,
    ``np`` a multiple of ``ng``), however this torch release takes GQA (module docstring)."""
    fn = _varlen_fn()
    names = parameter_names(fn)
    kw = {"scale": scale}
    # causal is window_size == (-1, 0), compared as a tuple inside varlen_attn: a list would
    # silently run non-causal attention
    if names is None or "window_size" in names:
        kw["window_size"] = (-1, 0)
    elif "is_causal" in names:
        kw["is_causal"] = True
    else:
        raise TypeError(f"torch {torch.__version__}'s varlen_attn takes neither window_size nor "
                        f"is_causal: expected one of them for causal attention")
    rep = q.shape[1] // k.shape[1]
    mode, _ = varlen_gqa_mode(fn)
    if rep == 1:
        return fn(q, k, v, cu, cu, max_len, max_len, **kw)
    if mode == "enable_gqa":
        return fn(q, k, v, cu, cu, max_len, max_len, enable_gqa=True, **kw)
    if mode == "native":
        try:
            out = fn(q, k, v, cu, cu, max_len, max_len, **kw)
        except (RuntimeError, ValueError) as e:
            if fn in _VARLEN_MODE:       # native worked before: not a GQA refusal
                raise
            _VARLEN_MODE[fn] = ("repeat", f"the kernel refused {q.shape[1]} query heads on "
                                              f"{k.shape[1]} K/V heads: {str(e)[:200]}")
        else:
            _VARLEN_MODE.setdefault(fn, ("native", varlen_gqa_mode(fn)[1]))
            return out
    k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    return fn(q, k, v, cu, cu, max_len, max_len, **kw)
