"""FlashAttention-4's CuTe DSL block-sparse kernels called directly (backend ``fa4``; Hopper).

Targets ``flash-attn-4`` 4.0.0b36 with ``nvidia-cutlass-dsl`` 4.8.1 (the wheels
``scripts/gpu_wheels.sh`` packs for torch 2.11): ``flash_attn.cute.interface._flash_attn_fwd`` /
``_flash_attn_bwd`` with ``block_sparse_tensors`` and a causal ``mask_mod``. Its public
``flash_attn_func`` is not used: it is an autograd Function, not the ``custom_op`` pair below
(the forward writes into our ``out`` and hands back its log-sum-exp for our backward), and
4.0.0b8's dropped the block-sparse tensors and the mask_mod in the backward (4.0.0b36 takes them,
``block_sparse_tensors_bwd``). The block-sparse backward refuses ``cu_seqlens`` (4.0.0b36:
"Varlen backward with block sparsity is not yet supported"; the forward takes varlen lists), so
a packed micro-batch runs as one sequence in the block layout: documents start on block
boundaries, the kernel sees the ``NB * B`` rows of the layout's blocks, the block ids are global.
The sequence length is a run-time value of FA4's compiled kernels (its compile key holds no
length), so no fixed padded length is needed.

From 4.0.0b8 to 4.0.0b36: ``_flash_attn_fwd`` returns five values (out, lse and three MLA-only
ones), so the log-sum-exp is taken by position; the arguments passed here kept their names and
meaning, ``BlockSparseTensorsTorch`` its first four fields (then varlen offsets, ``block_size``,
deterministic-backward write orders), and the lists their layout. What this backend relies on
since: the Hopper block-sparse backward waits for its preprocess (4.0.0b26, PR #2756; before it,
gradients were now and then garbage or NaN), and its head-dim-64 gradients were confirmed right
on 4.0.0b11 when given the transposed lists, as here (issue #2623, wrong gradients through
4.0.0b5's public function, which gave the backward none).

GQA without copies: the KV groups are FA4's *batch* (q ``[ng, T, rep, hn]``, k/v ``[ng, T, 1,
hn]``, views of ``[T, heads, hn]``), so a block list per group is FA4's ``[B=ng, H=1, ...]``
list, broadcast over the group's query heads. The forward packs the group's heads into its row
tiles (``pack_gqa``, which FA4 keeps only for lists with ``H == 1``; a packed tile maps to the
sparse block of its tokens); the backward never packs and sums dK/dV over the group's heads
in float32 before the cast: every (key block, query head) program adds its dK/dV tile to a
float32 accumulator (atomics, then a conversion pass), work per key block and head whatever
the density. ``bwd_per_head`` (``BWD_PER_HEAD`` by default) instead hands the backward K and V
repeated per query head (one KV head per query head: each program stores its own dK/dV tile,
no accumulator), then sums the group's heads in float32; it costs the copies of K and V and
rounds each head's dK/dV to the input dtype before the sum. Which is faster is the device's to
say: the kernel table times both (``scripts/bench.py attention_gpu``, variant ``bwd per head``).

The lists. For query block i the diagonal block i is the only partial block: documents start on
block boundaries, so it holds its own document's tokens then padding, and causality by position
(the mask_mod ``kv <= q``) is all that is left for real queries; a short block's padding keys lie
after all its real queries. Padding query rows compute values that ``layout.unpad`` drops and get
a zero output gradient, so they add nothing to dK/dV. Every other kept block (sinks, window,
selection) is full. Forward: partial = the diagonal, full = ``q_idx``; backward (FA4 walks key
blocks and takes the transposed lists as given, ``[B, H, key blocks, W]``; it derives none):
partial = the diagonal, full = ``kv_idx``.

FA4 wants 128x128 sparse blocks on Hopper (4.0.0b36 as 4.0.0b8): the KV block must equal its key
tile (no KV sub-tiles on Hopper), which is 128 columns at head dim <= 128 (the backward's 96 / 64
beyond; 4.0.0b36's forward narrows its tiles to a smaller block, its backward does not, so block
64 is refused there); the query block a multiple of its row tile, 128 forward (the 192-row tile
at head dim <= 96 does not divide 128, so FA4 takes 128), 128 backward at head dim <= 64 and 64
above (two row tiles per block). Blackwell's forward runs two 128-row Q tiles per CTA (256-row
sparse blocks), so only compute capability 9.x is accepted.

Contract (T = NB * B tokens of the block layout, B = 128, ``rep = np / ng``; every tensor on
one CUDA device; bf16/fp: bfloat16 or float16):

==========  ======================  =======  ==============================================
argument    shape                   dtype    meaning
==========  ======================  =======  ==============================================
q           [T, np, hn]             bf16/fp  queries, any strides (made contiguous)
k, v        [T, ng, hn]             as q     keys, values
q_num       [ng, NB]                int32    kept key blocks of query block i, diagonal not
                                             counted
q_idx       [ng, NB, Wq]            int32    those blocks, ascending global ids; entries past
                                             q_num unread but in [0, NB); 1 <= Wq <= NB
kv_num      [ng, NB]                int32    query blocks i != j that keep key block j
kv_idx      [ng, NB, Wk]            int32    those blocks, ascending; as q_idx
returned    [T, np, hn]             as q     attention output (contiguous)
(saved)     lse [ng, rep, T]        float32  log-sum-exp per row, for the backward only
==========  ======================  =======  ==============================================

The lists are the ``triton`` backend's, made by its fused selection
(``sparse_triton_select.triton_block_sparse(kernel="fa4")``: ``block_lists.lists_from_ranking``
with the selection) where its tiles take the head dim (a power of two), else by the generic
selection and ``build_block_lists(selection)`` (``api._sparse_attention``); on the device, no
host sync; handed over as they are: same widths
(``Wq = max(1, K - 1)``, ``Wk = max(1, longest document's blocks - 1)``), int32, contiguous,
ascending. Its entries past a count hold the row's own block, which is in ``[0, NB)``; FA4 reads
none of them (4.0.0b36 ``block_sparse_utils.py``: every loop over a list stops at its count; its
``block_sparsity.py`` takes lists narrower than the block count, "compact block sparse indices").
Importing this module needs neither flash-attn-4, triton nor a GPU; ``fa4_missing`` says what is
missing. Pure torch; must not import megatron or torch.distributed.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional, Tuple

import torch


FA4_BLOCK = 128                      # the sparse block FA4's Hopper tiles accept (see above)
BWD_PER_HEAD = False                 # the backward on K/V repeated per query head (see above)
FA4_DTYPES = (torch.bfloat16, torch.float16)
INSTALL_HINT = ("pip install --pre 'flash-attn-4[cu13]' (4.0.0b36 with nvidia-cutlass-dsl "
                "4.8.1: scripts/gpu_wheels.sh, docs/GPU.md)")


@functools.lru_cache(maxsize=1)
def have_fa4() -> bool:
    """Whether ``flash_attn.cute`` can be found (probed once; its kernels are not imported)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:         # no flash_attn package at all
        return False


def fa4_missing(device) -> Optional[str]:
    """Why the ``fa4`` backend cannot run on ``device`` (None when it can): CUDA, a Hopper GPU
    (compute capability 9.x), flash-attn-4, CuTe DSL's ``cutlass`` and triton (the lists'
    builder)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "it needs a CUDA device"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major != 9:
        return (f"it needs a Hopper GPU (compute capability 9.x, this one is {major}.{minor}): "
                f"FA4's block-sparse tiles take 128-token blocks there only")
    if not have_fa4():
        return f"flash-attn-4 is not installed ({INSTALL_HINT})"
    if importlib.util.find_spec("cutlass") is None:
        return ("CuTe DSL's cutlass package is not importable: nvidia-cutlass-dsl 4.8.1 keeps it "
                "in nvidia_cutlass_dsl/dsl_packages, which its .pth file puts on sys.path; a pip "
                "--target folder on PYTHONPATH reads no .pth file, so add that folder too")
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (the block lists are built by a Triton kernel)"
    return None


def fa4_shape_problem(dtype, head_dim: int, block_size: int) -> Optional[str]:
    """Why FA4's Hopper block-sparse kernels refuse this dtype / head dim / block size, or None."""
    if dtype not in FA4_DTYPES:
        return f"dtype {dtype}: expected torch.bfloat16 or torch.float16"
    if block_size != FA4_BLOCK:
        return (f"block_size={block_size}: expected {FA4_BLOCK} (FA4's Hopper tiles; "
                f"--sb-block-size {FA4_BLOCK})")
    if head_dim % 8 or not 8 <= head_dim <= 128:
        return (f"head dim {head_dim}: expected a multiple of 8 up to 128 (FA4's key tile is "
                f"{FA4_BLOCK} wide only there)")
    return None


def check_lists(q_num, q_idx, kv_num, kv_idx, num_groups: int, num_blocks: int) -> None:
    """Shapes and dtypes of our list format (no device values read); ValueError naming the
    tensor."""
    for name, x, dims in (("q_num", q_num, 2), ("q_idx", q_idx, 3), ("kv_num", kv_num, 2),
                          ("kv_idx", kv_idx, 3)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int32 or x.dim() != dims:
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)
            raise ValueError(f"{name}: expected a {dims}-D int32 tensor, got {got}")
        if tuple(x.shape[:2]) != (num_groups, num_blocks):
            raise ValueError(f"{name} has shape {tuple(x.shape)}: expected [{num_groups}, "
                             f"{num_blocks}, ...] (KV groups, blocks)")
        if dims == 3 and not 1 <= x.shape[2] <= num_blocks:
            raise ValueError(f"{name} has width {x.shape[2]}: expected 1 to {num_blocks}")


_DIAGONALS: dict = {}                 # (block count, device) -> the diagonal lists
_DIAGONALS_KEPT = 16


def _diagonal(num_blocks: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The partial lists, one entry per block (its own): ``[1, 1, NB]`` ones and ``[1, 1, NB,
    1]`` block ids, broadcast by FA4 over groups and heads. Built once per block count and
    device (two fills), then read by every layer's forward and backward of every micro-batch of
    that many blocks (the last ``_DIAGONALS_KEPT`` counts are kept); under a fake mode (FA4's
    compile-only check) built each time: fake tensors hold nothing to keep."""
    from torch._guards import detect_fake_mode
    key = (num_blocks, str(torch.device(device)))
    if detect_fake_mode() is None and key in _DIAGONALS:
        return _DIAGONALS[key]
    cnt = torch.ones(1, 1, num_blocks, dtype=torch.int32, device=device)
    idx = torch.arange(num_blocks, dtype=torch.int32, device=device).view(1, 1, num_blocks, 1)
    if detect_fake_mode() is None:
        if len(_DIAGONALS) >= _DIAGONALS_KEPT:
            _DIAGONALS.pop(next(iter(_DIAGONALS)))
        _DIAGONALS[key] = (cnt, idx)
    return cnt, idx


def fa4_sparse_tensors(num: torch.Tensor, idx: torch.Tensor):
    """FA4's ``(mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx)`` from one side
    of our lists (``q_num, q_idx`` for the forward, ``kv_num, kv_idx`` for the backward): the
    diagonal as the partial list, ``[ng, 1, NB(, W)]`` views of ours as the full list."""
    nb = num.shape[1]
    mask_cnt, mask_idx = _diagonal(nb, num.device)
    return mask_cnt, mask_idx, num.contiguous().unsqueeze(1), idx.contiguous().unsqueeze(1)


@functools.lru_cache(maxsize=1)
def _causal_mask_mod():
    """CuTe DSL mask_mod ``kv <= q`` (global positions), applied to the diagonal blocks only.
    Built once: FA4 keys its compile cache on the function's hash."""
    import cutlass.cute as cute

    @cute.jit
    def causal(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        return n_idx <= m_idx

    return causal


def _groups(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[T, heads, hn] contiguous -> FA4's [ng, T, heads / ng, hn] view (groups as the batch)."""
    t, h, hn = x.shape
    return x.view(t, num_groups, h // num_groups, hn).permute(1, 0, 2, 3)


def _sparse(lists, block_size: int):
    """FA4's ``BlockSparseTensorsTorch``; the block size given, not inferred from the length."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    return BlockSparseTensorsTorch(*lists, block_size=(block_size, block_size))


def forward_kernel(q, k, v, q_num, q_idx, block_size: int, softmax_scale: float):
    """FA4's block-sparse forward on our lists -> (out [T, np, hn], lse [ng, rep, T]).
    Runs the kernel, or only compiles it under a FakeTensorMode (FA4's compile-only mode)."""
    from flash_attn.cute import interface
    ng = k.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    lse = interface._flash_attn_fwd(
        _groups(q, ng), _groups(k, ng), _groups(v, ng), softmax_scale=softmax_scale,
        mask_mod=_causal_mask_mod(), return_lse=True, out=_groups(out, ng),
        block_sparse_tensors=_sparse(fa4_sparse_tensors(q_num, q_idx), block_size))[1]
    return out, lse


def backward_kernel(dout, q, k, v, out, lse, kv_num, kv_idx, block_size: int,
                    softmax_scale: float, per_head: bool = False):
    """FA4's block-sparse backward on the transposed lists -> (dq, dk, dv), contiguous; with
    ``per_head`` on K/V repeated per query head, the group's dK/dV summed after (module
    docstring)."""
    from flash_attn.cute import interface
    t, nh, hn = q.shape
    ng = k.shape[1]
    rep = nh // ng
    per_head = per_head and rep > 1
    dout = dout.contiguous()
    if per_head:                 # query head g * rep + r reads KV head g: repeated in place
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    interface._flash_attn_bwd(
        _groups(q, ng), _groups(k, ng), _groups(v, ng), _groups(out, ng), _groups(dout, ng),
        lse, softmax_scale=softmax_scale, mask_mod=_causal_mask_mod(),
        block_sparse_tensors=_sparse(fa4_sparse_tensors(kv_num, kv_idx), block_size),
        dq=_groups(dq, ng), dk=_groups(dk, ng), dv=_groups(dv, ng))
    if per_head:
        dk, dv = (x.view(t, ng, rep, hn).sum(dim=2, dtype=torch.float32).to(q.dtype)
                  for x in (dk, dv))
    return dq, dk, dv


@torch.library.custom_op("sparsebalance::fa4_block_sparse_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_num: torch.Tensor,
            q_idx: torch.Tensor, kv_num: torch.Tensor, kv_idx: torch.Tensor, block_size: int,
            softmax_scale: float, bwd_per_head: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    # kv_num / kv_idx / bwd_per_head are inputs so that setup_context keeps them for the
    # backward
    return forward_kernel(q, k, v, q_num, q_idx, block_size, softmax_scale)


@_fwd_op.register_fake
def _(q, k, v, q_num, q_idx, kv_num, kv_idx, block_size, softmax_scale, bwd_per_head):
    t, nh, _ = q.shape
    ng = k.shape[1]
    return q.new_empty(q.shape), q.new_empty((ng, nh // ng, t), dtype=torch.float32)


@torch.library.custom_op("sparsebalance::fa4_block_sparse_bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, lse: torch.Tensor, kv_num: torch.Tensor, kv_idx: torch.Tensor,
            block_size: int, softmax_scale: float, per_head: bool
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward_kernel(dout, q.contiguous(), k.contiguous(), v.contiguous(), out, lse,
                           kv_num, kv_idx, block_size, softmax_scale, per_head)


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, kv_num, kv_idx, block_size, softmax_scale, per_head):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, _, _, kv_num, kv_idx, block_size, softmax_scale, bwd_per_head = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_num, kv_idx)
    ctx.block_size, ctx.softmax_scale, ctx.per_head = block_size, softmax_scale, bwd_per_head


def _backward(ctx, dout, _dlse):
    # lse is internal (fa4_block_sparse_attention returns out only): its gradient is ignored
    q, k, v, out, lse, kv_num, kv_idx = ctx.saved_tensors
    dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, kv_num, kv_idx, ctx.block_size,
                         ctx.softmax_scale, ctx.per_head)
    return dq, dk, dv, None, None, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def fa4_block_sparse_attention(q, k, v, q_num, q_idx, kv_num, kv_idx, *, block_size: int,
                               softmax_scale: float,
                               bwd_per_head: Optional[bool] = None) -> torch.Tensor:
    """Block-sparse causal attention of one block-aligned sequence on our lists (module
    docstring's contract) -> out ``[T, np, hn]``; differentiable in q, k and v.
    ``bwd_per_head``: the backward's GQA form (module docstring; None: ``BWD_PER_HEAD``).
    Shapes, dtypes and the block size are checked here (ValueError naming the value); the
    device is not."""
    t, nh, hn = q.shape
    ng = k.shape[1]
    why = fa4_shape_problem(q.dtype, hn, block_size)
    if why is not None:
        raise ValueError(f"backend='fa4': {why}")
    if t % block_size:
        raise ValueError(f"q has {t} rows: expected a multiple of block_size={block_size} "
                         f"(the block layout's blocks)")
    check_lists(q_num, q_idx, kv_num, kv_idx, ng, t // block_size)
    per_head = BWD_PER_HEAD if bwd_per_head is None else bool(bwd_per_head)
    out, _ = _fwd_op(q, k, v, q_num, q_idx, kv_num, kv_idx, block_size, float(softmax_scale),
                     per_head)
    return out
