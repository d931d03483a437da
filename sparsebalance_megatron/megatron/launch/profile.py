"""Profile forward+backward time of one pipeline stage of the configured GPT on this device.

Each stage kind (first: embedding + layers; middle: layers; last: layers + LM head + loss; only:
all of it) is built as a megatron-core ``GPTModel`` with ``pre_process`` / ``post_process`` and
the stage's layer count, with the SparseBalance layer spec (``spec.get_sparsebalance_layer_spec``)
on a 1-process gloo group. Packed (THD) micro-batches over a grid of document-length mixes x
densities are timed with warm-up and repeats (each mix ``seq_length`` tokens packed as training
packs them, padding included: ``default_mixes``); the median goes into a latency table
(``latency/table.py``) whose coefficients are fitted by ``LatencyModel.fit``.
The stage is built with the run's transformer implementation and activation recomputation, and
the table records them with the tensor-parallel size (its ``execution`` section). Only TP = 1 can
be profiled: a 1-process stage cannot measure tensor-parallel GEMM shards and their all-reduces,
and no model of them is attempted; a TP > 1 run needs ``--sb-latency-table-force`` with a TP = 1
table (and then predicts TP = 1 times, which the online calibration can only scale).

Not for use inside a running training job (it initialises its own 1-process model-parallel state).
Imports megatron; ``megatron/profile_cli.py`` is the thin command-line front end.

Why this is long: building a stage, timing its micro-batches and writing the table share the
one-process set-up and the table's identity; the command line is already apart (``profile_cli.py``).
"""

from __future__ import annotations

import math
import os
import platform
import socket
import time
import warnings
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from ...config import SparseBalanceConfig
from ...latency.features import FEATURES
from ...latency.shape import ModelShape
from ...latency.table import FORMAT, FORMAT_VERSION, stage_kinds_for
from ...plan import BudgetPlan
from ..model.budget import BudgetContext, SparsePackedSeqParams
from .profile_grid import QUICK_MIXES, default_mixes, padded_length_warning  # noqa: F401


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"cpu: {model} x{os.cpu_count()}"


def software_versions() -> dict:
    from megatron.core import package_info

    from ... import __version__ as sb_version
    return {"torch": torch.__version__, "megatron_core": package_info.__version__,
            "sparsebalance_megatron": sb_version}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(seed: int = 1234) -> None:
    """A 1-process gloo (or NCCL) group and megatron-core parallel state (idempotent)."""
    from datetime import timedelta

    from megatron.core import parallel_state, tensor_parallel

    from ..runtime import comm
    from .compat import activate_cpu_shims
    if parallel_state.model_parallel_is_initialized():
        return
    activate_cpu_shims()
    # Its own rendezvous, always: launched from inside a torchrun job (a run profiling its table
    # at start-up) it inherits that job's MASTER_PORT and agent store, which it must not join.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    comm.init_process_group("nccl" if torch.cuda.is_available() else "gloo", 1, 0,
                            timedelta(minutes=10))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=1)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _layer_spec(sb: SparseBalanceConfig, transformer_impl: str = "local"):
    """The training layer spec of ``transformer_impl`` (only ``core_attention`` swapped)."""
    from ..model.spec import get_sparsebalance_layer_spec

    if transformer_impl == "local":
        return get_sparsebalance_layer_spec(sb, transformer_impl="local", qk_layernorm=False,
                                            normalization="RMSNorm")
    # the TE spec takes its norm from the config (TENorm reads config.normalization)
    return get_sparsebalance_layer_spec(sb, transformer_impl=transformer_impl, qk_layernorm=False)


def _budget_of(model) -> BudgetContext:
    """The budget context the model's sparse attention layers share (built by ``_layer_spec``)."""
    from ..model.core_attention import SparseCoreAttention

    for module in model.modules():
        if isinstance(module, SparseCoreAttention):
            return module.budget
    raise ValueError("the profiled model has no SparseCoreAttention layer")


def build_stage(shape: ModelShape, sb: SparseBalanceConfig, kind: str, num_layers: int,
                bf16: bool | None = None):
    """A GPTModel holding one pipeline stage of ``kind`` with ``num_layers`` layers. In bf16 (on
    CUDA unless ``bf16`` says otherwise) it is wrapped in Megatron's Float16Module, as
    pretrain()'s get_model wraps it: every parameter bf16 (the norms' too, which the torch norm
    otherwise keeps in float32 and so feeds the next linear float32), a first stage's inputs and
    a last stage's output cast."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    bf16 = torch.cuda.is_available() if bf16 is None else bf16

    cfg = TransformerConfig(
        num_layers=num_layers, hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size, num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups, kv_channels=shape.kv_channels,
        normalization="RMSNorm", gated_linear_unit=shape.swiglu,
        activation_func=F.silu if shape.swiglu else F.gelu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        pipeline_model_parallel_size=1, gradient_accumulation_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, batch_p2p_sync=False,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        **_recompute_config(shape.recompute_granularity))
    model = GPTModel(config=cfg, transformer_layer_spec=_layer_spec(sb, shape.transformer_impl),
                     vocab_size=shape.vocab_size, max_sequence_length=shape.seq_length,
                     pre_process=kind in ("first", "only"), post_process=kind in ("last", "only"),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    if bf16:
        model = Float16Module(cfg, model)
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return model.to(dev), dev


def _recompute_config(granularity: str) -> dict:
    """TransformerConfig fields of ``--recompute-granularity``: selective recomputes Megatron's
    default modules (the core attention); full recomputes every layer (uniform, one layer per
    checkpoint: every layer's forward runs twice, as with any uniform split)."""
    if granularity == "none":
        return {}
    if granularity == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1}


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def microbatch_inputs(model, dev, shape: ModelShape, doc_lengths: Sequence[int]) -> tuple:
    """(packed-sequence params, token ids [1, t], positions [1, t], a stage input [t, 1, h]) of
    one packed micro-batch of ``doc_lengths``, random, seeded by its token count."""
    t = int(sum(doc_lengths))
    cu = torch.tensor([0] + np.cumsum(doc_lengths).tolist(), dtype=torch.int32, device=dev)
    psp = SparsePackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                max_seqlen_q=int(max(doc_lengths)),
                                max_seqlen_kv=int(max(doc_lengths)), sb_step=0, sb_microbatch=0)
    g = torch.Generator(device="cpu").manual_seed(t)
    tokens = torch.randint(0, shape.vocab_size, (1, t), generator=g).to(dev)
    pos = torch.cat([torch.arange(n) for n in doc_lengths]).unsqueeze(0).to(dev)
    dtype = next(model.parameters()).dtype
    hidden = torch.randn(t, 1, shape.hidden_size, generator=g).to(dev, dtype)  # [s, b, h]
    return psp, tokens, pos, hidden


def time_microbatch(model, dev, kind: str, shape: ModelShape, doc_lengths: Sequence[int],
                    density: float, repeats: int, warmup: int, statistic: str = "median"
                    ) -> tuple[float, float]:
    """Median (or min) (fwd_s, bwd_s) over ``repeats`` runs of one packed micro-batch."""
    stat = {"median": np.median, "min": np.min}[statistic]
    psp, tokens, pos, hidden = microbatch_inputs(model, dev, shape, doc_lengths)
    budget = _budget_of(model)
    budget.set_plan(BudgetPlan.static(0, density, 1, 1, 1), dp_rank=0, stage=0)
    fwd, bwd = [], []
    try:
        for i in range(warmup + repeats):
            model.zero_grad(set_to_none=True)
            x_in = None
            if kind in ("middle", "last"):
                x_in = hidden.clone().requires_grad_(True)
                model.set_input_tensor(x_in)
            labels = tokens if kind in ("last", "only") else None
            _sync(dev)
            t0 = time.perf_counter()
            out = model(tokens if kind in ("first", "only") else None, pos, None,
                        labels=labels, packed_seq_params=psp)
            _sync(dev)
            t1 = time.perf_counter()
            if labels is not None:
                out.float().mean().backward()
            else:
                out.backward(torch.ones_like(out))
            _sync(dev)
            t2 = time.perf_counter()
            if i >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
    finally:
        budget.set_plan(None, dp_rank=0, stage=0)
        budget.pop_served()
        budget.pop_stats()
    if not fwd:   # warm-up only
        return 0.0, 0.0
    return float(stat(fwd)), float(stat(bwd))


def profile_identity(shape: ModelShape, sb: SparseBalanceConfig, *, densities, mixes,
                     repeats: int, warmup: int, statistic: str, dense_crossover: bool) -> dict:
    """What the samples of ``profile_table`` with these arguments depend on: the identity of
    its partial profile (``latency/partial.py``), which a retry resumes only when equal."""
    import dataclasses

    return {"device": device_name(), "software": software_versions(),
            "model": shape.as_table_model(), "execution": shape.as_table_execution(),
            "pp": shape.pp, "config": dataclasses.asdict(sb),
            "densities": [float(d) for d in densities],
            "mixes": [[int(x) for x in m] for m in mixes], "repeats": repeats,
            "warmup": warmup, "statistic": statistic, "dense_crossover": bool(dense_crossover),
            "threads": torch.get_num_threads()}


def profile_table(shape: ModelShape, sb: SparseBalanceConfig, *, densities: Sequence[float],
                  mixes: Sequence[Sequence[int]], repeats: int = 3, warmup: int = 1,
                  statistic: str = "median", progress: Optional[Callable] = None,
                  dense_crossover: bool = False, partial=None) -> dict:
    """Measure every (stage kind, mix, density) and return a validated, fitted table; with
    ``dense_crossover`` the crossover first (``launch/crossover.py``), and the grid routed at it.
    With ``partial`` (a ``latency.partial.PartialProfile`` of ``profile_identity``) every
    sample is saved as it is measured and the samples it holds already are not measured again
    (a stage kind whose samples are all there is not even built)."""
    import dataclasses

    from ...attention import resolve_backend
    from ...latency.model import LatencyModel

    if shape.num_layers < shape.pp:
        raise ValueError(f"--num-layers={shape.num_layers} is less than "
                         f"--pipeline-model-parallel-size={shape.pp}: no layer for a stage")
    shape.check_profilable()
    init_single_process(sb.seed)
    kinds = stage_kinds_for(shape.pp)
    # Every stage kind is measured at the same layer count (the even split, rounded down); with
    # pp >= 2 a middle stage is measured too, even at pp = 2: it is one layer's cost x per_stage,
    # from which ``LatencyModel.with_layout`` predicts any uneven or interleaved layout.
    per_stage = shape.num_layers // shape.pp
    measured = sorted(set(kinds) | ({"middle"} if shape.pp >= 2 else set()))
    # Repeats are passes over the whole grid, not back-to-back runs: a burst of load from other
    # processes then spoils one sample of many points instead of every sample of one point.
    stat = {"median": np.median, "min": np.min}[statistic]
    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    why = padded_length_warning(mixes, sb.block_size, dev_type)
    if why is not None:
        warnings.warn(why, stacklevel=2)
    from .crossover import choose_backend, crossover_of_shape
    saved = partial if partial is not None else {}
    if "backend_choice" in saved:
        backend_choice = saved.get("backend_choice")["choice"]
        if backend_choice:
            sb = dataclasses.replace(sb, attention_backend=backend_choice["chosen"])
    else:
        sb, backend_choice = choose_backend(shape, sb, repeats, warmup)  # 'auto' on CUDA
        if partial is not None:
            partial.put("backend_choice", {"choice": backend_choice})
    if "crossover" in saved:
        routing = saved.get("crossover")
    else:
        routing = crossover_of_shape(shape, sb, repeats, warmup) if dense_crossover else {}
        if partial is not None:
            partial.put("crossover", routing)
    meas = []
    points = [(m, d) for m in mixes for d in densities]
    total = len(measured) * len(points) * repeats
    if partial is not None and "total" not in partial:
        partial.put("total", total)
    bar = progress(total=total) if progress else None
    for kind in measured:
        keys = [[f"{kind}/{r}/{j}" for j in range(len(points))] for r in range(repeats)]
        todo = [k for row in keys for k in row if k not in saved]
        if bar is not None and len(todo) < repeats * len(points):
            bar.update(repeats * len(points) - len(todo))
        if todo:
            torch.manual_seed(sb.seed)
            model, dev = build_stage(shape, sb, kind, per_stage)  # one stage in memory at a time
            _budget_of(model).set_routing(routing.get("dense_crossover_tokens", 0))
            # first-touch allocations and lazy init happen here, not in the first grid point
            time_microbatch(model, dev, kind, shape, max(mixes, key=len), max(densities), 0, 1)
        samples = [[] for _ in points]
        for r in range(repeats):
            for j, (mix, density) in enumerate(points):
                if keys[r][j] in saved:
                    samples[j].append(tuple(saved.get(keys[r][j])))
                    continue
                samples[j].append(time_microbatch(model, dev, kind, shape, mix, density, 1,
                                                  warmup))
                if partial is not None:
                    partial.put(keys[r][j], list(samples[j][-1]))
                if bar is not None:
                    f, b = samples[j][-1]
                    bar.set_postfix_str(f"{kind} docs={len(mix)} d={density:g} "
                                        f"{1e3 * (f + b):.1f}ms")
                    bar.update(1)
        for (mix, density), smp in zip(points, samples):
            arr = np.asarray(smp)                               # [repeats, 2]
            meas.append({"kind": kind, "doc_lengths": [int(x) for x in mix],
                         "density": float(density), "fwd_s": float(stat(arr[:, 0])),
                         "bwd_s": float(stat(arr[:, 1])),
                         "samples_s": [[float(a), float(b)] for a, b in smp]})
        if todo:
            del model
    if bar is not None:
        bar.close()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = {
        **routing, "format": FORMAT, "format_version": FORMAT_VERSION, "source": "profiled",
        "device": device_name(), "software": software_versions(),
        "model": shape.as_table_model(),
        "execution": shape.as_table_execution(),
        "attention": {"block_size": sb.block_size, "sink_blocks": sb.sink_blocks,
                      "local_blocks": sb.local_blocks, "backend": sb.attention_backend,
                      **({"backend_choice": backend_choice} if backend_choice else {}),
                      "estimator": sb.estimator, "query_chunk_blocks": sb.query_chunk_blocks,
                      # the CPU kernel pads query-block chunks; FlexAttention keeps exact pairs
                      "work": "chunked" if resolve_backend(sb.attention_backend, dev) == "torch"
                      else "kept"},
        "pipeline": {"pp": shape.pp, "stage_kinds": kinds, "layers_per_stage": [per_stage] * shape.pp},
        "features": list(FEATURES),
        "measurements": meas,
        "profile": {"repeats": repeats, "warmup": warmup, "statistic": statistic,
                    "repeat_order": "passes over the grid",
                    "token_totals": sorted({int(sum(m)) for m in mixes}),
                    "threads": torch.get_num_threads(),
                    "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
    return LatencyModel.fit(table, where="<profile>").table


def fit_report(table: dict) -> list[tuple[str, float, float, int]]:
    """(kind, grid MAPE fwd+bwd, max abs % error, n) of the fitted coefficients on the grid."""
    from ...latency.model import LatencyModel

    m = LatencyModel.from_table(table)
    rows = []
    for kind in sorted(set(table["pipeline"]["stage_kinds"])):
        ms = [x for x in table["measurements"] if x["kind"] == kind]
        stage = table["pipeline"]["stage_kinds"].index(kind)
        pred = m.predict_many([x["doc_lengths"] for x in ms], np.array([x["density"] for x in ms]),
                              stage)
        meas = np.array([x["fwd_s"] + x["bwd_s"] for x in ms])
        err = np.abs(pred - meas) / meas
        rows.append((kind, float(err.mean()), float(err.max()), len(ms)))
    return rows


def mape(pred, meas) -> float:
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    return float(np.mean(np.abs(pred - meas) / meas)) if meas.size else math.nan
