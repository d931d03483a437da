"""SparseBalanceConfig: the one place where every knob of the plugin is declared.

Each field carries its documentation in ``metadata["help"]``; ``arguments.py`` generates the CLI
flags from these fields, so help text, defaults and validation never drift apart.
This module must not import megatron or torch.

Why this is long: it is the one declaration of every flag, a field with its help text each, so
its length is the number of flags; spread over several files the flags would drift apart again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

ANCHORS = ("mean", "max")
BACKENDS = ("auto", "triton", "fa4", "flex", "flash", "torch", "reference")
DENSE_KERNELS = ("auto", "varlen", "sdpa")   # attention/dense.py: the dense kernels of routing
SELECTION_MODES = ("density", "mass")
ESTIMATORS = ("maxkey", "pooled")
LONG_SAMPLE_POLICIES = ("split", "error")
TOKENIZERS = ("qwen", "gpt2", "byte")
DOC_UNITS = ("file", "section")
PACKINGS = ("auto", "sequential", "token_balanced", "sab")
RAISE_TARGETS = ("bottleneck", "static")
STAND_DOWNS = ("sequential", "token_balanced", "dp_balanced", "off")   # policy/stand_down.py
STAND_DOWN_COMPARES = ("static", "planned")   # policy/stand_down.py: what the packings race
DST_OBJECTIVES = ("density", "quality")
DST_DESCENTS = ("critical_path", "off")   # policy/critical_path.py
TIMING_SOURCES = ("measured", "model")
EVAL_DENSITIES = ("d0", "trained")   # megatron/step/eval_profile.py
PLANNERS = ("process", "thread", "inline")   # megatron/step/ahead.py
PLANNER_TIMEOUT_S = 30.0   # --sb-planner-timeout's default (megatron/step/ahead.py)
FAULT_KINDS = ("raise", "hang", "kill", "exit", "planner-kill-idle", "planner-kill-drafting",
               "planner-kill-agreeing", "planner-stop", "fa4-fails", "triton-fails")
CP_COMM_TYPES = ("a2a",)   # Megatron's --cp-comm-type values the plugin's attention implements
MAX_EXCHANGE_RATE = 1.0  # nats per token per 1% of step: 'auto' where density buys no time
DEFAULT_RAISE_HEADROOM = 0.05  # --sb-raise-headroom auto, before any step has measured the error
MAX_RAISE_HEADROOM = 0.5


PATH_KINDS = ("input", "output", "directory")


def _f(default, help: str, choices=None, path=None, **kw):
    """A config field: its help text, choices, and for a flag naming a file or directory its
    ``path`` kind (``PATH_KINDS``: a file the run reads, a file it writes, a directory it writes
    into), which ``megatron/launch/preflight.py`` checks before the launch does any work."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if path is not None:
        assert path in PATH_KINDS, path
        meta["path"] = path
    return field(default=default, metadata=meta, **kw)


def path_fields(kind: str) -> list[str]:
    """Names of the fields whose flag names a path of ``kind`` (``PATH_KINDS``)."""
    return [f.name for f in dataclasses.fields(SparseBalanceConfig)
            if f.metadata.get("path") == kind]


def _auto_or_count(v) -> Optional[int]:
    """A field that is 'auto' or a count >= 0 (an int, or digits as the flag parser gives them):
    the count, or None for 'auto' or a value out of that domain (``validate`` names those)."""
    if isinstance(v, bool) or v == "auto":
        return None
    if isinstance(v, str) and v.isascii() and v.isdigit():
        return int(v)
    return v if isinstance(v, int) and v >= 0 else None


def _auto_or_number(v, hi: float = float("inf")) -> Optional[float]:
    """A field that is 'auto' or a number in [0, hi] (``hi`` itself excluded where infinite):
    the number, or None for 'auto' or a value out of that domain (``validate`` names those)."""
    if isinstance(v, bool) or v == "auto":
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if 0.0 <= x <= hi and x < float("inf") else None


def flag_name(field_name: str) -> str:
    """CLI flag of a config field: ``sparse_balance`` -> ``--sparse-balance``, else ``--sb-<name>``."""
    if field_name == "sparse_balance":
        return "--sparse-balance"
    return "--sb-" + field_name.replace("_", "-")


def dest_name(field_name: str) -> str:
    """argparse destination of a field: Megatron's args namespace is flat, so we prefix ``sb_``."""
    return "sparse_balance" if field_name == "sparse_balance" else "sb_" + field_name


class ConfigError(ValueError):
    """A configuration value is out of its domain; the message names the flag and the value.
    ``problems``: one entry per bad value (``SparseBalanceConfig.validate`` names them all)."""

    def __init__(self, message: str, problems: Optional[list] = None):
        super().__init__(message)
        self.problems = list(problems) if problems else [message]


@dataclass
class SparseBalanceConfig:
    """All SparseBalance settings. Defaults give a plain (dense) Megatron run."""

    # --- switches -------------------------------------------------------------------------
    sparse_balance: bool = _f(
        False, "Turn on the whole system: budgeted block-sparse attention, dynamic sparsity "
        "tuning (DST) and sparsity-aware batching (SAB).")
    sparse_attention: bool = _f(
        False, "Use budgeted block-sparse attention at the static density --sb-density "
        "(no DST, no SAB) unless those are switched on too.")
    dst: bool = _f(
        False, "Dynamic sparsity tuning alone: plan a density per (rank, micro-batch, stage) "
        "each step. Implies sparse attention.")
    batching: bool = _f(
        False, "Sparsity-aware batching alone: pack and assign samples by predicted latency. "
        "Without --sb-sparse-attention or --sb-dst the attention stays dense (no sparse call): "
        "SAB packing for a dense run, priced by the dense kernel.")

    # --- attention budget -----------------------------------------------------------------
    density: float = _f(0.5, "Base density d0 in (0, 1]: kept key blocks / causal key blocks.")
    min_density: float = _f(0.125, "Lowest density DST may cut to (d_min), in (0, 1].")
    max_density: float = _f(1.0, "Highest density DST may raise to (d_max), in (0, 1].")
    block_size: int = _f(64, "Attention block size in tokens; a positive power of two.")
    sink_blocks: int = _f(1, "Blocks at the start of each document that are always kept.")
    local_blocks: int = _f(0, "Extra always-kept blocks just before the diagonal block.")
    selection_mode: str = _f(
        "density", "Fill the budget by top-k at the density ('density') or by an estimated "
        "attention-mass threshold clipped to [min, max] density ('mass').",
        choices=SELECTION_MODES)
    mass_threshold: float = _f(0.9, "Mass threshold tau in (0, 1] for --sb-selection-mode mass.")
    estimator: str = _f(
        "maxkey", "Block-score estimator: 'maxkey' (pooled query x every key, max per block) "
        "or 'pooled' (pooled query x pooled key).", choices=ESTIMATORS)
    attention_backend: str = _f(
        "auto", "Sparse kernel: 'flex' (FlexAttention's Triton kernel, CUDA), 'flash' "
        "(FlexAttention's FlashAttention-4 kernel: Hopper or newer with flash-attn-4 "
        "installed), 'fa4' (FlashAttention-4's block-sparse CuTe kernels called directly: "
        "Hopper, block 128, bf16/fp16, flash-attn-4 installed; the fastest measured, takes any "
        "micro-batch length), 'triton' (the plugin's own Triton block-sparse FlashAttention, "
        "CUDA; takes any micro-batch length), 'torch' (blockwise PyTorch), 'reference' (dense "
        "masked SDPA oracle), or 'auto' (on CUDA with variable-length micro-batches "
        "(--sb-microbatch-multiple auto) the faster of fa4 and triton that serves the model, "
        "as the latency profile measures them; else the backend it measured fastest, flex "
        "where none was measured; torch on CPU).",
        choices=BACKENDS)
    query_chunk_blocks: int = _f(
        16, "Query blocks processed at once by the torch kernel; bounds its memory.")
    dense_below_tokens: str = _f(
        "auto", "Dense where dense wins: documents shorter than this many tokens go through one "
        "dense varlen attention call instead of the block selection and the sparse kernel, and "
        "count at density 1 (DST cannot cut them). 'auto': the crossover measured on the device "
        "and stored in the latency table (no routing without a table or when the table has "
        "none); 0: never route; N > 0: documents under N tokens.")
    dense_kernel: str = _f(
        "auto", "Dense kernel on CUDA in float16/bfloat16, of routed documents and of dense "
        "runs on the local spec (--sb-batching without sparse attention): 'varlen' (one "
        "FlashAttention varlen call over the packed documents), 'sdpa' (cuDNN SDPA over the "
        "documents grouped by length, padded to a bounded set of lengths so torch builds few "
        "cuDNN graphs) "
        "or 'auto' (varlen); elsewhere the exact "
        "per-document SDPA loop.", choices=DENSE_KERNELS)

    # --- DST ------------------------------------------------------------------------------
    anchor: str = _f(
        "mean", "DST anchor over predicted unit times: mean, or max (never cut, only "
        "raise).", choices=ANCHORS)
    tolerance: float = _f(0.1, "DST tolerance p >= 0: units above (1+p) x anchor are cut.")
    density_floor: float = _f(
        0.9, "DST keeps each step's mean density (weighted by layers x attention work) at or above this "
        "fraction of --sb-density by cutting fewer units when the raises cannot pay the cuts "
        "back; 0 = the paper's rule unchanged.")
    stage_density_floor: float = _f(
        0.75, "DST keeps every pipeline stage's density in a step (weighted by layers x attention work) at "
        "or above this fraction of --sb-density, by cutting fewer units, so no stage's layers "
        "are starved to pay for another's (the LM-head stage is the usual victim); 0 = off.")
    raise_to: str = _f(
        "bottleneck", "How far bubble filling raises densities: under the cut plan's step time "
        "('bottleneck': the balance gain is speed) or up to the static plan's step time at "
        "--sb-density ('static': the balance gain becomes density, the step no slower than "
        "static sparse attention).", choices=RAISE_TARGETS)
    stand_down: str = _f(
        "sequential", "Do no harm, every step: a DST plan predicted slower than the static plan "
        "(every unit at --sb-density) of the same micro-batches is not committed (the static "
        "plan is), and SAB's packing is replaced by this baseline packing ('sequential': "
        "Megatron's fill; 'token_balanced'; 'dp_balanced': Megatron's dp_balanced packer, its "
        "own micro-batch count per step, micro-batches of their documents only) unless the "
        "latency model predicts SAB's step faster (on the plans --sb-stand-down-compare "
        "names); 'off': commit SAB and DST as planned (an "
        "ablation). The metrics and the [sparsebalance] line count the stand-downs.",
        choices=STAND_DOWNS)
    stand_down_compare: str = _f(
        "planned", "What --sb-stand-down compares SAB's packing with the baseline's on: "
        "'planned' (the default: DST plans both packings and their plans are compared, so the "
        "choice also weighs what DST recovers of the baseline's imbalance) or 'static' (each "
        "packing's static plan, every unit at --sb-density; DST then plans only the packing "
        "chosen: half the planner's DST work, for steps up to 1% slower where DST would have "
        "made the baseline's packing the faster). Either way the committed step is predicted "
        "no slower than the baseline packing's static plan.", choices=STAND_DOWN_COMPARES)
    dst_objective: str = _f(
        "quality", "What DST keeps while it balances: 'quality' (the default: cuts and raises "
        "go where density buys the most predicted quality per attention-second under the "
        "measured convex quality cost --sb-quality-cost, and a plan may not lose predicted LM "
        "loss against uniform --sb-density; where the critical-path descent does not follow "
        "(--sb-dst-descent off) the density objective's plan competes and the one the quality "
        "cost prefers at the same speed is kept; the floors still apply; plans 1.5-4x slower, "
        "off the critical path with the default --sb-planner process) or 'density' (only the "
        "mean and per-stage density floors; cuts take the least sensitive micro-batches "
        "first).", choices=DST_OBJECTIVES)
    dst_descent: str = _f(
        "critical_path", "After its band search, DST descends the pipeline's critical path "
        "(policy/critical_path.py): units on a path longer than the step's target are cut, units "
        "with float raised, and that plan is kept only if it meets the same floors (and quality "
        "rule), keeps the mean density at --sb-density or above, and is predicted faster. It "
        "may cut inside the --sb-tolerance band (a stage that holds the longest path); 'off': "
        "the band rule alone decides what is cut.",
        choices=DST_DESCENTS)
    quality_cost: Optional[str] = _f(
        None, "Quality model JSON for --sb-dst-objective quality (scripts/bench.py plan_quality "
        "--calibrate: held-out loss against density per depth group and document length of a "
        "real model, convex, with its bootstrap uncertainty); default: the shipped SmolLM2-135M "
        "model.", path="input")
    quality_refresh_interval: int = _f(
        0, "With --sb-dst-objective quality: every N iterations (0: never, the default) the "
        "quality model DST plans by follows the network being trained: every rank runs "
        "forward-only passes (Megatron's schedule, evaluation mode, no gradient) of a fixed "
        "held-out batch per DP rank from the valid split (--split's valid share, or "
        "--valid-data-path), at uniform --sb-density and "
        "with each depth group of the model's layers in turn at 0.8x (where DST cuts to), and "
        "each group's curve is scaled by the measured loss change over the predicted one "
        "(clamped to [1/4, 4], "
        "shrunk by its standard error over the documents), so the plans drafted after it "
        "price cuts and raises as the network now pays them. Costs 1 + groups forward passes "
        "of --sb-quality-refresh-microbatches micro-batches per refresh (the metrics' "
        "quality_refresh_s, part of sb_overhead_s). Off by default: the shipped model was "
        "measured on a trained network, and a network early in training is noisy to measure.")
    quality_refresh_microbatches: int = _f(
        1, "With --sb-quality-refresh-interval: the held-out batch the refresh measures is the "
        "valid split's first K micro-batches per DP rank (K rows of DP bins, packed as "
        "Megatron's evaluation packs them; default 1). Costs K x (1 + groups) micro-batch "
        "forward passes per refresh. The change's standard error is taken over the batch's "
        "documents: a refresh whose batch holds one document in all (long documents, DP 1) "
        "has no spread to measure and moves no scale, so give it more micro-batches (one "
        "global batch's worth per DP rank measures what Megatron's evaluation reads in one "
        "iteration).")
    exchange_rate: str = _f(
        "auto", "With --sb-dst-objective quality: what one percent of predicted step time is "
        "worth in predicted held-out loss (nats per token). A plan that cuts is adopted only "
        "where its speed gain x this rate pays for its predicted loss change plus the quality "
        "model's uncertainty (one bootstrap SD), against DST's plan without cuts (raises into "
        "the pipeline's bubbles only), and only where it is not predicted worse than uniform "
        "--sb-density by more than that uncertainty; else the step keeps the plan without "
        "cuts. 'auto': the step's own uniform trade, the loss per percent of step time that "
        "lowering every unit's density from --sb-density to 0.9x saves (predicted by the same "
        "quality and latency models), so DST's cuts are kept where they trade speed for "
        "quality at least as well as uniform sparsity would; a number >= 0 fixes it (0: quality "
        "alone decides; large: the fastest plan the uncertainty rule allows).")
    eval_density: str = _f(
        "d0", "The density of Megatron's evaluation forwards (--eval-interval, --skip-train) in "
        "a run with DST: 'd0' (the default), uniform --sb-density; 'trained', the network read "
        "as it trained: each decoder layer at the mean, over the run's steps so far, of the "
        "work-weighted density DST planned its pipeline stage at, the profile scaled by one "
        "factor so that the model's kept attention work on the documents trained on (the blocks "
        "the selection keeps, sink, local and diagonal included) is uniform --sb-density's. A network trained under DST's plans loses more read back "
        "at uniform d0 than read at its own profile (QUALITY.md, the three-stage training "
        "study). The profile is checkpointed; each step's record holds it "
        "(eval_density_per_stage).", choices=EVAL_DENSITIES)
    raise_headroom: str = _f(
        "auto", "Bubble filling raises a unit only while its predicted time stays below "
        "(1 - h) x the step's bottleneck, so that a latency-model error of h does not turn the "
        f"raised unit into the new straggler. A fraction h in [0, {MAX_RAISE_HEADROOM}], or "
        "'auto': the median relative error of the calibrated latency model over recent steps "
        f"({DEFAULT_RAISE_HEADROOM} before any).")

    # --- latency model --------------------------------------------------------------------
    latency_table: Optional[str] = _f(
        None, "Profiled latency table (JSON, from sparsebalance-profile). Without one, a "
        "table is profiled at start-up on this device.", path="input")
    latency_table_force: bool = _f(
        False, "Use --sb-latency-table even if it was measured on another device, model "
        "shape or software version.")
    calibration_ema: float = _f(
        0.3, "Weight in (0, 1] of a new measurement in the per-rank latency correction EMA.")
    profile_timeout_minutes: float = _f(
        60.0, "Without --sb-latency-table: how long the other ranks wait for rank 0 to profile "
        "the latency table at start-up (minutes, > 0; they wait on a group of their own, not "
        "under --distributed-timeout-minutes, and print progress). A profile cut short "
        "resumes on the next run from its saved samples.")

    # --- batching and data ----------------------------------------------------------------
    packing: str = _f(
        "auto", "How a step's documents become micro-batches: Megatron's 'sequential' fill, "
        "'token_balanced' (balance token counts, what a length-aware balancer does) or 'sab' "
        "(predicted latency + sensitivity); 'auto' = sab with SAB on, else sequential.",
        choices=PACKINGS)
    sensitivity_signal: str = _f(
        "loss", "What orders samples and micro-batches by sparsity sensitivity (SAB's grouping, "
        "DST's cut and raise order): 'loss' (minus each document's mean training loss: "
        "well-predicted text loses most when sparsified; Spearman +0.50 with the measured loss "
        "change on SmolLM2) or 'recall' (1 - the estimator's kept attention mass; measured "
        "anti-correlated, -0.45).", choices=("loss", "recall"))
    long_sample_policy: str = _f(
        "split", "A document longer than --seq-length is split into segments ('split') or "
        "refused with an error ('error').", choices=LONG_SAMPLE_POLICIES)
    seq_pad_multiple: int = _f(
        0, "Pad every packed document (after its EOD, outside the loss) to a multiple of this "
        "many positions; 0: automatic, 2 x --context-parallel-size (what Megatron's "
        "context-parallel split of a packed micro-batch needs), 1 without context parallelism. "
        "Give the CP run's value to a CP=1 run to compute the CP run's numbers on the same plans "
        "(--sb-replay-plans: each run plans with its own latency model otherwise).")
    microbatch_multiple: str = _f(
        "auto", "0: every packed micro-batch is --seq-length tokens, padding fills what its "
        "documents leave (Megatron's fixed shapes). K > 0: variable-length micro-batches, each "
        "as long as its documents rounded up to a multiple of K tokens (at most --seq-length), "
        "so the fill costs no linear-layer time; the plugin turns on Megatron's "
        "variable_seq_lengths (pipeline stages exchange shapes). K must be a multiple of the "
        "document padding (2 x CP) and, with sequence parallelism, of TP x CP. 'auto': "
        "variable (a multiple of 128 that meets those) where SAB packs for dense attention on "
        "the plugin's data path (dense attention takes any length, as Megatron's own "
        "dp_balanced packer feeds it) and for sparse attention through the triton backend "
        "(its kernels take any length; 'auto' on CUDA runs it where it serves the model), else "
        "0: with sparse attention through any other backend (flex compiles a kernel per "
        "length), a HybridModel, CUDA "
        "graphs (fixed shapes), or a --sb-latency-table profiled at one token total (it "
        "cannot price shorter micro-batches); with --sb-replay-plans, the multiple the plans "
        "were packed at. The launch line says which and why.")
    tokenizer: str = _f(
        "qwen", "Tokenizer of the built-in real-text corpus and of .jsonl data: 'qwen' "
        "(Qwen2 BPE via tiktoken), 'gpt2', or 'byte'.", choices=TOKENIZERS)
    doc_unit: str = _f(
        "file", "Documents of the built-in corpus: whole files/plays ('file') or their natural "
        "sections, top-level defs and scenes ('section'; a heavier tail at short contexts).",
        choices=DOC_UNITS)
    data_cache_dir: Optional[str] = _f(
        None, "Where the built-in corpus and the start-up latency profile are cached (default: "
        "~/.cache/sparsebalance_megatron).", path="directory")
    seed: int = _f(1234, "Seed of data shuffling and batching decisions.")

    # --- benchmarking -----------------------------------------------------------------------
    straggler_rank: int = _f(
        -1, "Benchmarking: data-parallel rank that emulates a slower device (-1: none).")
    straggler_slowdown: float = _f(
        1.0, "Benchmarking: how many times slower --sb-straggler-rank computes (>= 1); it "
        "sleeps in proportion to its measured forward time.")
    straggler_stage: int = _f(
        -1, "Benchmarking: the pipeline rank of --sb-straggler-rank that is slow (-1: all of "
        "them): one GPU of a pipeline, as thermal throttling or a bad link makes it.")
    timing_source: str = _f(
        "measured", "Per-micro-batch times that calibrate the latency model: Megatron's timers "
        "('measured'), or the latency model's own prediction, times --sb-straggler-slowdown on "
        "--sb-straggler-rank ('model': deterministic, for tests and reproducible studies).",
        choices=TIMING_SOURCES)

    fault: Optional[str] = _f(
        None, "Testing: inject a fault 'RANK:STEP:KIND' (several: comma-separated) into global "
        "rank RANK's forward step of "
        "iteration STEP (1-based); KIND is raise (an exception), hang (the rank stops "
        "answering), kill (the process dies) or exit (the process leaves with os._exit(0)); or "
        "into its planner process as it is asked for iteration STEP's draft: planner-kill-idle "
        "(killed before it is asked), planner-kill-drafting (killed once asked), "
        "planner-kill-agreeing (killed after the first of DST's rounds over the DP group it "
        "settles the draft with) or planner-stop (stopped with SIGSTOP: it stalls); or into the "
        "attention kernels: "
        "fa4-fails / triton-fails (that kernel raises on rank RANK from iteration STEP on, as a "
        "compile failure on a new shape; the run's kernels then stand in for the GPU ones: "
        "auto's pick is fa4 and fa4, triton and flex each compute with the torch kernel under "
        "their own name, so that the fallback runs on a CPU).")
    watchdog_seconds: str = _f(
        "auto", "Name the hung rank: a rank that has waited this many seconds in one collective "
        "reads every rank's heartbeat (published every few seconds on the job's store) and "
        "names the rank it waits for (stopped, exited, or making no progress outside any "
        "collective, evaluation, checkpoint save or load, optimizer step and data loading) with "
        "its last Python stack, then ends the job; never while a rank saves a checkpoint. "
        "'auto': the distributed "
        "timeout in effect (--distributed-timeout-minutes, then "
        "--distributed-timeout-seconds-after-init) less 10% (at least 2 s), so the job ends "
        "before a collective would time out; N > 0: after N seconds (less than the timeout); "
        "0: off. Watching starts at the first training micro-batch.")

    # --- resume and logging -----------------------------------------------------------------
    planner: str = _f(
        "process", "Where the next step is planned (document packing, latency features, DST). "
        "'process' (the default): step n+1 is planned in a process of its own (one per rank) "
        "while step n trains, so planning leaves the step's critical path and the training "
        "thread's CPU: only the plan's inputs and result pass through a pipe, and the plan's "
        "broadcast stays in the step. 'thread': the same on a thread of the training process "
        "(no process to start, but the planner holds the Python GIL while it drafts, which "
        "slows a training thread that launches many small kernels). 'inline': after the "
        "step, on its critical path, from the state the step just left. With 'process' and "
        "'thread' calibration and sensitivities reach the plans one step later (a step's plan "
        "uses the state after the step before the previous one); all three are deterministic "
        "and resume exactly. The planner's inner loops run compiled (numba). A planner process that dies or stalls costs one draft on the training "
        "thread, never the job: the same step is drafted there from the same inputs (the same "
        "plan), and a new process starts after 1, 2 and 4 such steps (then the training thread "
        "drafts every step); each event is one warning line and the sparsebalance/planner "
        "scalars count them.", choices=PLANNERS)
    planner_timeout: float = _f(
        PLANNER_TIMEOUT_S, "With --sb-planner process: the most seconds after it was asked for "
        "that a draft may take (at most half the distributed timeout in effect, too). Its "
        "deadline is 3x the recent drafts' median, at least 0.5 s, within that cap; past it "
        "the rank drafts the step itself from the same inputs (the same plan), so a stall "
        "costs a step about one draft: a planner process that cannot answer (stopped, state "
        "T) is killed, one that still runs is left to finish and its late draft dropped "
        "(killed if it is still not back at the next draft). A draft takes milliseconds to a "
        "few tenths of a second.")
    fresh_state: bool = _f(
        False, "On --load of a checkpoint whose SparseBalance state is missing (one written "
        "without the plugin's data path) or damaged (truncated, unreadable, another version), "
        "start the balancer fresh (latency calibration, sensitivities) with a warning naming "
        "the file, instead of refusing the resume.")
    metrics_file: Optional[str] = _f(
        None, "Append one JSON line per step (loss, step time, tokens/s, plan statistics) to "
        "this file on rank 0; it records every step's plan (documents per micro-batch, "
        "densities), which --sb-replay-plans replays. Its per-unit detail gathers every DP "
        "rank's rows each step (work per micro-batch and the plan's segments: bytes that grow "
        "with the DP size; the step's figures without it are a fixed-size all-reduce).",
        path="output")
    replay_plans: Optional[str] = _f(
        None, "Replay the plans another run recorded in its --sb-metrics-file instead of "
        "planning: every step packs the recorded documents into the recorded micro-batches "
        "and runs the recorded densities (same data, seed, batch sizes and DP size; any "
        "--context-parallel-size). A CP=N run replaying a CP=1 run's plans computes its "
        "numbers.", path="input")

    def __post_init__(self):
        self.validate()

    # Derived switches: --sparse-balance implies all three parts.
    @property
    def sparse_attention_enabled(self) -> bool:
        return self.sparse_balance or self.sparse_attention or self.dst

    @property
    def dst_enabled(self) -> bool:
        return self.sparse_balance or self.dst

    @property
    def batching_enabled(self) -> bool:
        return self.sparse_balance or self.batching or self.packing == "sab"

    @property
    def plan_ahead(self) -> bool:
        """Step n+1 is planned while step n trains (--sb-planner process or thread)."""
        return self.planner != "inline"

    @property
    def packing_method(self) -> str:
        if self.packing == "auto":
            return "sab" if self.batching_enabled else "sequential"
        return self.packing

    @property
    def varies_microbatch_count(self) -> bool:
        """Whether a step may commit a packing with its own micro-batch count and lengths: SAB
        standing down to Megatron's dp_balanced (``megatron/step/microbatches.py``)."""
        return self.packing_method == "sab" and self.stand_down == "dp_balanced"

    @property
    def dense_below_tokens_value(self) -> Optional[int]:
        """The fixed routing threshold, or None for 'auto' (or a value out of its domain)."""
        return _auto_or_count(self.dense_below_tokens)

    def routing_threshold(self, table_crossover: Optional[int]) -> int:
        """Documents shorter than this many tokens run dense: --sb-dense-below-tokens when a
        number, else (auto) the latency table's measured crossover (``table_crossover``; None: no
        table, or a table without one, which means no routing)."""
        fixed = self.dense_below_tokens_value
        if fixed is not None:
            return fixed
        return table_crossover or 0

    @property
    def microbatch_multiple_value(self) -> Optional[int]:
        """--sb-microbatch-multiple as a number, or None for 'auto' (or a value out of its
        domain)."""
        return _auto_or_count(self.microbatch_multiple)

    @property
    def length_multiple(self) -> int:
        """The micro-batches' length multiple (0: fixed --seq-length): the number given, or
        what the launch resolved 'auto' to (``megatron/launch/lengths.py``); 'auto' not yet
        resolved (a config outside a launch) is 0."""
        return self.microbatch_multiple_value or 0

    def pad_multiple(self, cp_size: int) -> int:
        """What packed documents are padded to a multiple of, under ``cp_size`` CP ranks."""
        return self.seq_pad_multiple or (2 * cp_size if cp_size > 1 else 1)

    @property
    def fault_specs(self) -> Optional[list[tuple[int, int, str]]]:
        """[(rank, iteration, kind)] of --sb-fault (comma-separated), [] without one, None where
        one of them is not RANK:STEP:KIND."""
        if not self.fault:
            return []
        out = []
        for spec in str(self.fault).split(","):
            parts = spec.split(":")
            if len(parts) != 3 or parts[2] not in FAULT_KINDS:
                return None
            try:
                rank, step = int(parts[0]), int(parts[1])
            except ValueError:
                return None
            if rank < 0 or step < 1:
                return None
            out.append((rank, step, parts[2]))
        return out

    @property
    def watchdog_seconds_value(self) -> Optional[float]:
        """The fixed watchdog threshold in seconds (0: off), or None for 'auto' (or a value out
        of its domain)."""
        return _auto_or_number(self.watchdog_seconds)

    @property
    def exchange_rate_value(self) -> Optional[float]:
        """The fixed exchange rate, or None for 'auto' (or a value out of its domain)."""
        return _auto_or_number(self.exchange_rate)

    @property
    def raise_headroom_value(self) -> Optional[float]:
        """The fixed raise headroom, or None for 'auto' (or a value out of its domain)."""
        return _auto_or_number(self.raise_headroom, MAX_RAISE_HEADROOM)

    @classmethod
    def unchecked(cls, **values) -> "SparseBalanceConfig":
        """A config of ``values`` not validated (for naming every problem, ``problems``, of
        values that may be bad); never run with one."""
        sb = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            setattr(sb, f.name, values.get(f.name, f.default))
        return sb

    def validate(self) -> None:
        """``ConfigError`` naming every bad value at once (the first alone hides the others)."""
        bad = self.problems()
        if bad:
            raise ConfigError("; ".join(bad), bad)

    def problems(self) -> list[str]:
        """Every value out of its domain, one ``--sb-flag=value: expected ...`` line each."""
        out: list[str] = []

        def bad(name, value, expected):
            out.append(f"{flag_name(name)}={value!r}: expected {expected}")

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v

        for name in ("density", "min_density", "max_density", "mass_threshold",
                     "calibration_ema"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v != v or not (0.0 < v <= 1.0):
                bad(name, v, "a number in (0, 1]")
        # the order of the three only when each is valid (a bad one is named once, above)
        ranged = all(number(v) and 0.0 < v <= 1.0
                     for v in (self.min_density, self.density, self.max_density))
        if ranged and self.min_density > self.max_density:
            bad("min_density", self.min_density,
                f"<= --sb-max-density ({self.max_density})")
        elif ranged and not (self.min_density <= self.density <= self.max_density):
            bad("density", self.density,
                f"a value within [--sb-min-density, --sb-max-density] = "
                f"[{self.min_density}, {self.max_density}]")
        t = self.profile_timeout_minutes
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < float("inf")):
            bad("profile_timeout_minutes", t, "a number of minutes > 0")
        b = self.block_size
        if not isinstance(b, int) or b <= 0 or (b & (b - 1)) != 0:
            bad("block_size", b, "a positive power of two (e.g. 64 or 128)")
        for name in ("sink_blocks", "local_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                bad(name, v, "an integer >= 0")
        if not isinstance(self.query_chunk_blocks, int) or self.query_chunk_blocks < 1:
            bad("query_chunk_blocks", self.query_chunk_blocks, "an integer >= 1")
        if self.dense_below_tokens != "auto" and self.dense_below_tokens_value is None:
            bad("dense_below_tokens", self.dense_below_tokens, "'auto' (the latency table's "
                "measured crossover) or an integer >= 0 (0: never route documents to dense "
                "attention)")
        if isinstance(self.seq_pad_multiple, bool) or not isinstance(self.seq_pad_multiple, int) \
                or self.seq_pad_multiple < 0:
            bad("seq_pad_multiple", self.seq_pad_multiple, "an integer >= 0 (0: automatic)")
        if self.microbatch_multiple != "auto" and self.microbatch_multiple_value is None:
            bad("microbatch_multiple", self.microbatch_multiple,
                "'auto' or an integer >= 0 (0: fixed --seq-length micro-batches)")
        if not isinstance(self.straggler_rank, int) or self.straggler_rank < -1:
            bad("straggler_rank", self.straggler_rank, "-1 or a data-parallel rank >= 0")
        if isinstance(self.straggler_stage, bool) or not isinstance(self.straggler_stage, int) \
                or self.straggler_stage < -1:
            bad("straggler_stage", self.straggler_stage, "-1 or a pipeline rank >= 0")
        sd = self.straggler_slowdown
        if not isinstance(sd, (int, float)) or sd != sd or not (1.0 <= sd <= 100.0):
            bad("straggler_slowdown", sd, "a number in [1, 100]")
        for name in ("density_floor", "stage_density_floor"):
            fl = getattr(self, name)
            if not isinstance(fl, (int, float)) or fl != fl or not (0.0 <= fl <= 1.0):
                bad(name, fl, "a number in [0, 1]")
        t = self.tolerance
        if not isinstance(t, (int, float)) or t != t or t < 0 or t > 10:
            bad("tolerance", t, "a number in [0, 10]")
        ri = self.quality_refresh_interval
        if isinstance(ri, bool) or not isinstance(ri, int) or ri < 0:
            bad("quality_refresh_interval", ri, "an integer >= 0 (0: never)")
        rk = self.quality_refresh_microbatches
        if isinstance(rk, bool) or not isinstance(rk, int) or rk < 1:
            bad("quality_refresh_microbatches", rk, "an integer >= 1")
        if self.exchange_rate != "auto" and self.exchange_rate_value is None:
            bad("exchange_rate", self.exchange_rate, "'auto' or a number of nats per token >= 0")
        pt = self.planner_timeout
        if isinstance(pt, bool) or not isinstance(pt, (int, float)) or not (0 < pt < float("inf")):
            bad("planner_timeout", pt, "a number of seconds > 0")
        if self.fault and not self.fault_specs:
            bad("fault", self.fault, "RANK:STEP:KIND (comma-separated for several) with RANK "
                ">= 0, STEP >= 1 and KIND one of " + ", ".join(FAULT_KINDS))
        if self.watchdog_seconds != "auto" and self.watchdog_seconds_value is None:
            bad("watchdog_seconds", self.watchdog_seconds,
                "'auto' (the distributed timeout less a margin), 0 (off) or a number of seconds "
                "> 0")
        if self.raise_headroom_value is None and self.raise_headroom != "auto":
            bad("raise_headroom", self.raise_headroom,
                f"'auto' or a number in [0, {MAX_RAISE_HEADROOM}]")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                bad(f.name, getattr(self, f.name), "one of " + ", ".join(choices))
        return out
