"""``scripts/studies/gpu_trace.py``: a steady step's profiler trace accounted (non-attention,
attention per pass with FA4's side passes apart, selection and lists, copies and fills, GPU idle),
on synthetic CUDA events named as the real kernels are (cuDNN SDPA, FA4's CuTe kernels, our
Triton kernels, cuBLAS GEMMs, memcpy / memset, fills) and on a real CPU profiler trace of the
sparse attention with GPU events attached to its real launch points; the step's bound; the
pieces probe (``fa4_pieces``): its row, a trace's summary per call, the gpu_check step that
runs it."""

import gzip
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "scripts") not in sys.path:
    sys.path.insert(0, str(REPO / "scripts"))

from studies import gpu_trace as gt  # noqa: E402
from studies.fa4_pieces import pieces_row  # noqa: E402

CUDNN_FWD = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0"
CUDNN_BWD = "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x1x1_kernel0_0"
_FA4 = "kernel_cutlass_kernel_flash_attncute{}_object_at__tensorptrbf16gmemalign16oi64div8_0"
FA4_FWD = _FA4.format("flash_fwd_sm90FlashAttentionForwardSm90")
FA4_PRE = _FA4.format("flash_bwd_preprocessFlashAttentionBackwardPreprocess")
FA4_BWD = _FA4.format("flash_bwd_sm90FlashAttentionBackwardSm90")
FA4_POST = _FA4.format("flash_bwd_postprocessFlashAttentionBackwardPostprocess")
GEMM = "nvjet_tst_256x128_64x4_2x1_v_bz_TNT"
XMMA = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_"
        "execute_segment_k_off_kernel__5x_cublas")
FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
        "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)")
COPY = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::"
        "native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>(int)")
INDEX_COPY = ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<"
              "at::native::index_copy_kernel_impl<at::native::OpaqueType<2> > > >(long)")
TOPK = "void at::native::sbtopk::gatherTopK<float, unsigned int, 3, false>(at::cuda::detail::TensorInfo<float, unsigned int>)"
GEMV = "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>(float)"
NORM = "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>(int)"
FA4_BWD_OP = "sparsebalance::fa4_block_sparse_bwd"
SEL = "sparsebalance::selection"


class Trace:
    """A trace as Kineto writes it: a ``ProfilerStep#`` annotation, CPU ops (nested ranges on a
    thread), a launch event (``cuda_runtime``/``cuda_driver``, with a ``correlation``) inside
    the innermost op, and the GPU event with the same ``correlation``."""

    def __init__(self, step=5):
        self.events, self.host, self.gpu, self.corr, self.step = [], 0.0, 1000.0, 0, step

    def kernel(self, name, dur, stack=(), gap=0.0, cat="kernel", tid=1, stream=7):
        self.corr += 1
        t = self.host = self.host + 10.0
        for depth, op in enumerate(stack):                 # ranges nest around the launch
            self.events.append({"ph": "X", "cat": "user_annotation" if op == SEL else "cpu_op",
                                "name": op, "pid": 1, "tid": tid, "ts": t - 5 + depth,
                                "dur": 8 - 2 * depth, "args": {}})
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                            "pid": 1, "tid": tid, "ts": t, "dur": 1.0,
                            "args": {"correlation": self.corr}})
        self.gpu += gap
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream,
                            "ts": self.gpu, "dur": dur,
                            "args": {"correlation": self.corr, "stream": stream}})
        self.gpu += dur
        return self

    def write(self, path):
        step = {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{self.step}",
                "pid": 1, "tid": 1, "ts": 0.0, "dur": self.host + 20.0, "args": {}}
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": [step, *self.events]}, f)
        return str(path)


def _sparse_step(t):
    """One layer of a fa4 sparse step (GQA: dK and dV converted), between GEMMs."""
    t.kernel(GEMM, 300).kernel(NORM, 20)
    t.kernel("_block_sums_kernel", 10, stack=(SEL,)).kernel("_maxkey_kernel", 40, stack=(SEL,))
    t.kernel(TOPK, 30, stack=(SEL, "aten::topk")).kernel("_lists_kernel", 15, stack=(SEL,))
    t.kernel(GEMV, 5, stack=(SEL, "aten::mv"))
    t.kernel(INDEX_COPY, 12, stack=("aten::index_copy",), gap=100.0)      # a host gap
    t.kernel(FA4_FWD, 200, stack=("sparsebalance::fa4_block_sparse_fwd",))
    t.kernel(XMMA, 250, tid=2)                                             # the backward thread
    t.kernel(FILL, 8, stack=(FA4_BWD_OP, "aten::zeros", "aten::fill_"), tid=2)
    t.kernel(FILL, 8, stack=(FA4_BWD_OP, "aten::zeros", "aten::fill_"), tid=2)
    t.kernel(FA4_PRE, 30, stack=(FA4_BWD_OP,), tid=2)
    t.kernel(FA4_BWD, 500, stack=(FA4_BWD_OP,), tid=2)
    for _ in range(3):                                                     # dQ, then dK, dV
        t.kernel(FA4_POST, 20, stack=(FA4_BWD_OP,), tid=2)
    t.kernel("Memcpy DtoD (Device -> Device)", 6, cat="gpu_memcpy", gap=50.0)
    return t


def test_a_sparse_step_is_accounted_by_kernel_and_pass(tmp_path):
    t = _sparse_step(Trace())
    got = gt.summarize_step(t.write(tmp_path / "rank-0.json.gz"))
    assert got["step"] == "ProfilerStep#5" and got["kernels"] == 18
    assert got["ms"] == pytest.approx({"non_attention": 0.57, "attention": 0.806,
                                       "selection": 0.1, "copies": 0.018})
    assert got["attention_passes"] == pytest.approx({"fwd": 0.2, "dkv_fill": 0.016,
                                                     "bwd_preprocess": 0.03, "bwd": 0.5,
                                                     "dq_convert": 0.02, "dkv_convert": 0.04})
    assert got["attention_by_kernel"] == pytest.approx({"fa4": 0.806})
    assert got["kernel_ms"] == pytest.approx(1.494)
    assert got["gpu_busy_ms"] == pytest.approx(1.494) and got["gpu_idle_ms"] == pytest.approx(0.15)
    assert got["busy_fraction"] == pytest.approx(1.494 / 1.644)
    assert got["gaps"][0] == {"ms": 0.1, "next": INDEX_COPY[:80], "launched_in": "aten::index_copy"}
    assert got["gaps"][1]["launched_in"] is None and got["gaps"][1]["ms"] == 0.05


def test_dense_cudnn_triton_and_flash_kernels_and_the_other_step(tmp_path):
    """cuDNN's SDPA and our Triton kernels by name, their side passes; kernels launched in
    another step are left out; a trace without the asked step says so."""
    t = Trace(step=4)
    t.kernel(CUDNN_FWD, 100).kernel(CUDNN_BWD, 250)
    t.kernel("fwd_kernel", 80, stack=("sparsebalance::sparse_attn_fwd",))
    t.kernel("bwd_pre_kernel", 9, stack=("sparsebalance::sparse_attn_bwd",))
    t.kernel("dkv_kernel", 190, stack=("sparsebalance::sparse_attn_bwd",))
    t.kernel("bwd_post_kernel", 11, stack=("sparsebalance::sparse_attn_bwd",))
    t.kernel("void pytorch_flash::flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits>(float)", 7)
    t.kernel("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits>()", 3)
    t.kernel(COPY, 4).kernel("Memset (Device)", 2, cat="gpu_memset")
    path = t.write(tmp_path / "t.json.gz")
    got = gt.summarize_step(path)
    assert got["attention_by_kernel"] == pytest.approx({"cudnn": 0.35, "triton": 0.29,
                                                        "flash": 0.01})
    assert got["attention_passes"] == pytest.approx({"fwd": 0.18, "bwd": 0.44,
                                                     "bwd_preprocess": 0.012,
                                                     "bwd_convert": 0.011, "dq_convert": 0.007})
    assert got["ms"]["copies"] == pytest.approx(0.006) and got["ms"]["non_attention"] == 0.0
    assert gt.summarize_step(path, step=4)["kernels"] == 10
    assert gt.summarize_step(path, step=3) == {"failed": f"no ProfilerStep#3 in {path}"}
    events = json.load(gzip.open(path, "rt"))["traceEvents"]
    events[0]["dur"] = events[5]["ts"] + 0.5          # the step ends after the 2nd launch
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert gt.summarize_step(path)["kernels"] == 2
    whole = gt.summarize_trace(path)                  # the whole trace, with its account
    assert whole["kernels"] == 10 and whole["account"]["ms"]["copies"] == pytest.approx(0.006)
    assert "failed" in gt.summarize_step(str(tmp_path / "none.json.gz"))


def test_a_real_cpu_trace_with_gpu_events_at_its_launch_points(tmp_path):
    """torch.profiler on the CPU over steps of a layer (a linear, the sparse attention through
    flex eagerly, which opens the selection's range): GPU events attached to its real ops'
    launch points are accounted by the real nesting (the top-k inside the selection's range;
    the GEMM of the linear outside; the pad's index_copy a copy)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.profiler import ProfilerActivity, profile, schedule

    from sparsebalance_megatron.attention import block_sparse_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(200, h, 16, generator=g) for h in (4, 2, 2))
    lin = torch.nn.Linear(64, 64)

    @torch.no_grad()                                  # CPU flex runs without autograd
    def layer():
        x = lin(q.reshape(200, 64)).view(200, 4, 16)
        block_sparse_attention(x, k, v, [0, 90, 200], 0.5, block_size=16, backend="flex",
                               compile_backend=None, cache={})
    path = str(tmp_path / "cpu.json")
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(2):
            layer()
            prof.step()
    events = json.load(open(path))["traceEvents"]
    cpu_only = gt.summarize_step(path)
    assert cpu_only["step"] == "ProfilerStep#1" and cpu_only["kernels"] == 0
    assert any(e.get("name") == gt.SELECTION_RANGE for e in events)
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    first = {}
    for e in ops:
        first.setdefault(e["name"], e)
    named = {"aten::topk": TOPK, "aten::addmm": GEMM, "aten::index_copy": INDEX_COPY}
    for n, (op, kernel) in enumerate(named.items()):
        e = first[op]
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                       "pid": e["pid"], "tid": e["tid"], "ts": e["ts"] + e["dur"] / 2,
                       "dur": 0.1, "args": {"correlation": 9000 + n}})
        events.append({"ph": "X", "cat": "kernel", "name": kernel, "pid": 0, "tid": 7,
                       "ts": e["ts"] + 1000.0 + n * 100, "dur": 10.0,
                       "args": {"correlation": 9000 + n, "stream": 7}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events}, f)
    got = gt.summarize_step(path)
    assert got["kernels"] == 3
    assert got["ms"] == pytest.approx({"non_attention": 0.01, "attention": 0.0,
                                       "selection": 0.01, "copies": 0.01})


def test_profile_flags_record_the_asked_step():
    flags = gt.profile_flags("/r", step=6)
    assert flags[flags.index("--profile-step-start") + 1] == "6"
    assert flags[flags.index("--profile-step-end") + 1] == "7"
    assert gt.profile_flags("/r")[3] == "2"
    with pytest.raises(ValueError, match="step=1: expected an integer >= 2"):
        gt.profile_flags("/r", step=1)


def test_a_steps_bound_is_its_non_attention_time_and_d_times_cudnns_attention():
    assert gt.step_bound(1953.0, 1000.0, 0.25) == 2203.0
    for bad, match in (((-1.0, 1.0, 0.5), "non_attention_ms=-1.0"),
                       ((1.0, float("nan"), 0.5), "cudnn_attention_ms=nan"),
                       ((1.0, 1.0, 0.0), r"density=0.0: expected a number in \(0, 1\]")):
        with pytest.raises(ValueError, match=match):
            gt.step_bound(*bad)
    dense = {"host_step_ms": 3000.0, "ms": {"attention": 1000.0}}
    assert gt.dense_split(dense) == (2000.0, 1000.0)
    assert gt.dense_split({"kernels": 0, "host_step_ms": 5.0}) is None
    rec = gt.bound_record(*gt.dense_split(dense), 0.25, 2695.0)
    assert rec["bound_ms"] == 2250.0 and rec["non_attention_ms"] == 2000.0
    assert rec["over_bound"] == pytest.approx(2695.0 / 2250.0 - 1)


def test_fa4_pieces_row_sums_the_side_passes_and_the_hosts_lead():
    account = {"ms": {"selection": 0.7, "copies": 0.1, "attention": 2.0, "non_attention": 0},
               "attention_passes": {"fwd": 0.5, "bwd": 1.2, "bwd_preprocess": 0.1,
                                    "dq_convert": 0.08, "dkv_convert": 0.04, "dkv_fill": 0.02},
               "attention_by_kernel": {"fa4": 1.94}}
    host = {"fa4_fwd": {"host_ms": 0.4, "gpu_ms": 0.55, "held": 0}, "call_fwd": {}}
    row = pieces_row(host, account)
    assert row["bwd_side_ms"] == pytest.approx(0.24) and row["other_ms"] == 0.0
    assert row["fwd_kernel_ms"] == 0.5 and row["selection_ms"] == 0.7
    assert row["fa4_fwd"]["host_over_gpu_ms"] == pytest.approx(-0.15)
    assert "call_fwd" not in row                       # no GPU: nothing timed


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is there")
def test_fa4_pieces_says_why_it_cannot_run(capsys):
    from studies import fa4_pieces
    assert fa4_pieces.main([]) == 2
    assert "the fa4 backend cannot run here: it needs a CUDA device" in capsys.readouterr().err


def test_a_pieces_trace_is_stated_per_call_pass_by_pass():
    """``fa4_pieces``: each pass profiled over several calls (no GPU event on a CPU), its
    summary per call (kernels, milliseconds and the costliest kernels divided, the busy
    fraction as it is), and the passes' accounts summed into the row's pieces."""
    import torch
    from studies import fa4_pieces as fp
    x = torch.randn(64, 64, requires_grad=True)
    got = fp.pass_kernels(lambda a: (a @ a).tanh(), [x], torch.ones(64, 64), calls=2)
    for p in ("fwd", "bwd"):
        assert got[p]["kernels"] == 0 and got[p]["top"] == [] and got[p]["ms"] == {}
    summary = {"kernels": 4, "kernel_ms": 3.5, "busy_fraction": 0.8,
               "top": [{"name": "flash_bwd", "ms": 3.0, "count": 2}],
               "account": {"ms": {"attention": 3.0, "copies": 0.5},
                           "attention_passes": {"bwd": 3.0}, "attention_by_kernel": {"fa4": 3.0}}}
    k = fp.per_call(summary, 2)
    assert k["kernel_ms"] == pytest.approx(1.75) and k["kernels"] == 2 and k["busy_fraction"] == 0.8
    assert k["top"][0] == {"name": "flash_bwd", "ms": 1.5, "count": 1.0}
    assert k["ms"] == {"attention": 1.5, "copies": 0.25}
    with pytest.raises(ValueError, match="calls=0: expected at least one"):
        fp.per_call(summary, 0)
    both = fp.summed([k, {"ms": {"selection": 0.2}, "attention_passes": {"fwd": 0.5}}])
    assert both["ms"] == {"attention": 1.5, "copies": 0.25, "selection": 0.2}
    assert both["attention_passes"] == {"bwd": 1.5, "fwd": 0.5}
    row = fp.pieces_row({"fwd": {}, "bwd": {}}, both)
    assert row["fwd_kernel_ms"] == 0.5 and row["bwd_kernel_ms"] == 1.5
    assert row["selection_ms"] == 0.2 and row["copies_ms"] == 0.25


def test_gpu_checks_pieces_step_runs_the_one_probe(monkeypatch, tmp_path):
    """gpu_check's ``pieces`` step (the device plan's fa4 call, first) runs ``scripts/bench.py
    fa4_pieces`` at its defaults (fa4 then triton, both shapes, d 0.25 then 1, one 32K
    document), rows to the call's ``$OUT`` as measured, a deadline under the step's limit."""
    import importlib
    import json
    ks = importlib.import_module("studies.device")
    from studies import fa4_pieces as fp
    assert (fp.BACKENDS, fp.SHAPES, fp.DENSITIES, fp.TOKENS) == (
        ("fa4", "triton"), ("8/2/128", "14/2/64"), (0.25, 1.0), 32768)
    cmds = []

    def fake_run(cmd, log, limit, env):
        cmds.append(cmd)
        with open(cmd[cmd.index("--jsonl") + 1], "w") as f:
            f.write(json.dumps({"backend": "fa4", "what": "call", "shape": "8/2/128",
                                "density": 0.25, "failed": "RuntimeError: x"}) + "\n")
        return 1, 2.0, "tail"

    monkeypatch.setattr(ks, "_run", fake_run)
    got = ks.step_pieces("py", str(tmp_path), str(tmp_path), 40, {})
    assert cmds[0][1:3] == ["scripts/bench.py", "fa4_pieces"]
    assert cmds[0][cmds[0].index("--deadline-s") + 1] == "30"
    assert cmds[0][cmds[0].index("--jsonl") + 1] == str(tmp_path / "pieces_rows.jsonl")
    assert got["rows"] == 1 and not got["ok"]
    assert got["failed_rows"] == ["fa4 call 8/2/128 d=0.25: RuntimeError: x"]


def test_a_pieces_row_is_measured_end_to_end_on_cpu(monkeypatch):
    """``fa4_pieces.measure`` through the torch backend's whole call on CPU (the probe's path
    without a device: no host/GPU split, no GPU kernel): one row per call with its pass times,
    pieces and per-pass kernels; a clock out of time starts none."""
    import torch
    from studies import kernels as kp
    from studies import fa4_pieces as fp
    init = kp.Case.__init__
    monkeypatch.setattr(kp.Case, "__init__", lambda self, *a, **k: init(
        self, *a, **dict(k, device="cpu", dtype=torch.float32)))
    log = kp.RowLog(None)
    assert fp.measure("torch", "4/2/32", 512, [0.5], 1, kp.Clock(None), log)
    (row,) = log.rows
    assert (row["kind"], row["what"], row["density"]) == ("pieces", "call", 0.5)
    assert row["fwd_ms"] > 0 and row["bwd_method"] == "retained graph" and "failed" not in row
    assert row["bwd_side_ms"] == 0.0 and set(row["kernels"]) == {"fwd", "bwd"}
    late = kp.Clock(deadline_s=1.0)
    assert not fp.measure("torch", "4/2/32", 512, [0.5], 1, late, kp.RowLog(None))
