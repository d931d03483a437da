"""The attention kernel fallback (``megatron/model/backend_fallback.py``) on the real kernels:
auto's first GPU kernel made to fail (a compile failure injected in its call), the next one of the
chain that runs here computes the call, forward and backward, as the dense reference does on the
same selection's density. The CPU tests inject failures into stand-ins
(tests/unit/test_backend_fallback.py, tests/distributed/test_edges.py)."""

import pytest
import torch

from sparsebalance_megatron.attention import block_sparse_attention
from sparsebalance_megatron.attention.api import backend_missing
from sparsebalance_megatron.megatron.model.backend_fallback import CHAIN, BackendFallback

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class Budget:
    def __init__(self, backend):
        self.attention_backend = backend

    def set_backend(self, b):
        self.attention_backend = b


def test_a_failing_first_kernel_falls_back_to_a_real_one(monkeypatch):
    from sparsebalance_megatron.attention import api

    monkeypatch.setattr(api, "_AUTO_MEASURED", {})
    t, nh, ng, hn = 4096, 8, 2, 128
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(t, h, hn, generator=g).to("cuda", torch.bfloat16).requires_grad_()
               for h in (nh, ng, ng))
    runs = [b for b in CHAIN if backend_missing(b, "cuda", dtype=q.dtype, head_dim=hn,
                                                block_size=128) is None]
    if len(runs) < 2:
        pytest.skip(f"two kernels of {CHAIN} must run here, {runs} do")
    first, said, tried = runs[0], [], []

    def call(backend, q_, k_, v_):
        tried.append(backend)
        if backend == first:
            raise RuntimeError(f"injected: the {first} kernel failed to compile on this shape")
        return block_sparse_attention(q_, k_, v_, [0, 1500, t], 0.5, block_size=128,
                                      backend=backend)

    budget = Budget(first)
    out, _ = BackendFallback(say=said.append).run(budget, "auto", q, k, v, call,
                                                  block_size=128, documents=2)
    assert budget.attention_backend == runs[1] and tried[0] == first and len(said) == 1
    ref, _ = block_sparse_attention(q, k, v, [0, 1500, t], 0.5, block_size=128,
                                    backend=runs[1])
    assert torch.equal(out, ref)
    out.float().sum().backward()                   # the fallback kernel's backward runs
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))
