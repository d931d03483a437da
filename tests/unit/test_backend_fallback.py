"""A GPU attention kernel that fails falls back to the next one ``auto`` picks
(``megatron/model/backend_fallback.py``), tested on the CPU with injected failures: the call's
kernels are fakes that raise where told; the real kernels' fallback on a GPU is
tests/gpu/test_backend_fallback_gpu.py, the whole run's (every rank follows, the latency model
re-priced, the metrics) tests/distributed/test_edges.py."""

from __future__ import annotations

import pytest
import torch

from sparsebalance_megatron.megatron.model.backend_fallback import (CHAIN, BackendFallback,
                                                                    corrupts_device)


@pytest.fixture(autouse=True)
def _auto_measured(monkeypatch):
    """A fallback registers its kernel as ``auto``'s: kept to the test."""
    from sparsebalance_megatron.attention import api

    monkeypatch.setattr(api, "_AUTO_MEASURED", {})


class Budget:
    def __init__(self, backend="fa4"):
        self.attention_backend = backend

    def set_backend(self, b):
        self.attention_backend = b


def _qkv(grad=True):
    q = torch.randn(64, 4, 16, requires_grad=grad)
    k = torch.randn(64, 2, 16, requires_grad=grad)
    return q, k, k.detach().clone().requires_grad_(grad)


class Kernels:
    """``call(backend, q, k, v)``: ``fails`` maps a backend to the error it raises (in the
    forward, or ``("backward", err)`` in its backward only)."""

    def __init__(self, fails):
        self.fails, self.calls = fails, []

    def __call__(self, backend, q, k, v):
        self.calls.append(backend)
        err = self.fails.get(backend)
        if isinstance(err, Exception):
            raise err
        out = q * 2.0
        if isinstance(err, tuple):                     # fails in its backward only
            out = _FailingBackward.apply(out, err[1])
        return out, None


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, err):
        ctx.err = err
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ctx.err


def _fallback(said):
    return BackendFallback(missing=lambda b, q: None, say=said.append)


@pytest.mark.reliability(area="attention", case="the fa4 kernel fails to compile on a new shape "
                         "(injected), auto's pick", expect="triton runs that call and the rest "
                         "of the run; one warning naming the kernel, the shape and the error")
def test_a_failing_kernel_falls_back_once_to_the_next_auto_picks():
    from sparsebalance_megatron.attention import api

    said, budget = [], Budget("fa4")
    fb, kernels = _fallback(said), Kernels({"fa4": RuntimeError("DSLRuntimeError: compile "
                                                                "failed for head dim 96")})
    q, k, v = _qkv()
    out, _ = fb.run(budget, "auto", q, k, v, kernels, block_size=128, documents=3)
    assert torch.equal(out, q * 2.0) and budget.attention_backend == "triton"
    assert kernels.calls[0] == "fa4" and set(kernels.calls[1:]) == {"triton"}
    assert len(said) == 1 and said[0].startswith(
        "[sparsebalance] warning: the fa4 attention kernel failed on q [64, 4, 16] / k [64, 2, "
        "16] float32, 3 document(s) (RuntimeError: DSLRuntimeError: compile failed for head "
        "dim 96); falling back to triton"), said
    assert fb.events == [{"from": "fa4", "to": "triton", "shape": "q [64, 4, 16] / k [64, 2, "
                          "16] float32, 3 document(s)", "error": "RuntimeError: DSLRuntimeError: "
                          "compile failed for head dim 96"}]
    assert api._AUTO_MEASURED["cpu"][0] == "triton"         # every later auto runs it too
    kernels.calls.clear()
    fb.run(budget, "auto", q, k, v, kernels, block_size=128)   # later calls: triton only
    assert kernels.calls == ["triton"] and len(said) == 1


def test_a_backward_that_cannot_compile_falls_back_at_the_forward():
    """FA4 compiles its backward at the first backward: the probe runs it on detached copies at
    the first training forward of a shape, so that the failure is met where it can be fallen
    back from; evaluation forwards (no grad) are not probed."""
    said, budget = [], Budget("fa4")
    fb = _fallback(said)
    kernels = Kernels({"fa4": ("backward", RuntimeError("backward kernel failed to compile"))})
    q, k, v = _qkv(grad=False)
    with torch.no_grad():
        fb.run(budget, "auto", q, k, v, kernels, block_size=128)
    assert budget.attention_backend == "fa4" and not said          # nothing probed
    q, k, v = _qkv()
    fb.run(budget, "auto", q, k, v, kernels, block_size=128)
    assert budget.attention_backend == "triton" and "backward kernel" in said[0]
    assert q.grad is None                      # the probe's backward ran on copies


def test_every_kernel_of_the_chain_failing_ends_with_the_last_error():
    said, budget = [], Budget("fa4")
    fb = _fallback(said)
    kernels = Kernels({b: RuntimeError(f"{b} raised") for b in CHAIN})
    with pytest.raises(RuntimeError, match="flex raised") as e:
        fb.run(budget, "auto", *_qkv(), kernels, block_size=128)
    assert "no other kernel of fa4, triton, flex can run here" in "".join(e.value.__notes__)
    assert [x["to"] for x in fb.events] == ["triton", "flex"] and len(said) == 2


@pytest.mark.reliability(area="attention", case="the fa4 kernel raises a CUDA error (an illegal "
                         "memory access)", expect="no fallback: the job ends, the error noted "
                         "with the kernel and the shape")
def test_a_failure_that_corrupts_the_device_still_ends_the_job():
    said, budget = [], Budget("fa4")
    fb = _fallback(said)
    err = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access") as e:
        fb.run(budget, "auto", *_qkv(), Kernels({"fa4": err}), block_size=128)
    assert "the fa4 attention kernel failed on q [64, 4, 16]" in "".join(e.value.__notes__)
    assert "leaves the device's state unusable" in "".join(e.value.__notes__)
    assert budget.attention_backend == "fa4" and not said and not fb.events
    assert corrupts_device(RuntimeError("CUDA error: device-side assert triggered"))
    assert not corrupts_device(RuntimeError("cutlass DSL: unsupported head dim"))
    with pytest.raises(torch.OutOfMemoryError):            # memory: not another kernel's to fix
        fb.run(budget, "auto", *_qkv(), Kernels({"fa4": torch.OutOfMemoryError("oom")}),
               block_size=128)
    assert not fb.events


def test_an_explicit_backend_or_one_off_the_chain_is_not_fallen_back_from():
    said = []
    fb = _fallback(said)
    kernels = Kernels({"fa4": RuntimeError("compile failed")})
    with pytest.raises(RuntimeError, match="compile failed"):      # the user asked for fa4
        fb.run(Budget(None), "fa4", *_qkv(), kernels, block_size=128)
    out, _ = fb.run(Budget(None), "auto", *_qkv(), Kernels({}), block_size=128)  # cpu: torch
    assert not said and not fb.events


def test_the_next_kernel_is_one_that_can_run_here():
    said, budget = [], Budget("fa4")
    fb = BackendFallback(missing=lambda b, q: "needs CUDA" if b == "triton" else None,
                         say=said.append)
    fb.run(budget, "auto", *_qkv(), Kernels({"fa4": RuntimeError("x")}), block_size=128)
    assert budget.attention_backend == "flex" and fb.events[0]["to"] == "flex"
