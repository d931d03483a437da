"""The SparseBalance training loop, built from Megatron's own parts.

Megatron's argument parser, ``setup_model_and_optimizer`` (GPTModel per stage, Megatron DDP,
Megatron optimizer + LR scheduler, ``--load``), ``train_step`` (the pipeline schedule from
``get_forward_backward_func``) and ``save_checkpoint``. What we add enters through Megatron's named
hooks: the layer spec, ``config.timers`` (per-micro-batch timings), ``config.finalize_model_grads_func``
(the end-of-step point), and the data iterator (packed THD micro-batches, read one step ahead).
"""

from __future__ import annotations

import json
import logging
import time
from functools import partial

import torch

from .. import plan as budget
from . import comm
from .initialize import initialize_distributed, parse_and_validate, setup_logging
from .timing import MicrobatchTimers

log = logging.getLogger("sparsebalance")


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss (Megatron's calculate_per_token_loss contract): (sum, tokens, report)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def make_forward_step(slowdown: float = 1.0):
    """Megatron forward_step_func: one packed micro-batch through this stage.

    ``slowdown`` > 1 emulates a slower device for straggler benchmarks (--sb-straggler-*): the
    forward sleeps so that forward + backward (about 3x the forward) take ``slowdown`` times longer.
    """
    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        budget.set_current_microbatch(mb["index"], mb["doc_ids"])
        psp = mb["packed_seq_params"]
        psp.sb_microbatch, psp.sb_doc_ids = mb["index"], mb["doc_ids"]  # recompute-safe budget
        t0 = time.perf_counter()
        output = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"],
                       packed_seq_params=mb["packed_seq_params"])
        if slowdown > 1.0:
            time.sleep(3.0 * (slowdown - 1.0) * (time.perf_counter() - t0))
        return output, partial(loss_func, mb["loss_mask"])
    return forward_step


def _load_corpus(args, sb):
    from ..data.corpus import load_corpus

    def load():
        try:
            return _load()
        except (ValueError, OSError) as e:  # DataError & co. name the file and the problem
            raise SystemExit(f"error: data: {e}")

    def _load():
        return load_corpus(args.data_path[0] if args.data_path else None, tokenizer=sb.tokenizer,
                           cache_dir=sb.data_cache_dir, compact_vocab=args.data_path is None,
                           doc_unit=sb.doc_unit)

    # Rank 0 builds the cache on first use; the others then open it.
    corpus = load() if comm.rank() == 0 else None
    comm.barrier()
    return corpus if corpus is not None else load()


def _padded_vocab(n: int, args) -> int:
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return ((n + multiple - 1) // multiple) * multiple


def build(argv=None):
    """Parse, initialise and build everything; returns the training state."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.utils import get_model_config
    from megatron.training.global_vars import set_global_variables
    from megatron.training.training import setup_model_and_optimizer

    from .data import StepBatcher
    from .model import make_model_provider
    from .runtime import SparseBalanceRuntime

    args, sb = parse_and_validate(argv)
    setup_logging(args.rank)
    initialize_distributed(args)
    corpus = _load_corpus(args, sb)
    args.padded_vocab_size = _padded_vocab(corpus.vocab_size, args)
    set_global_variables(args, build_tokenizer=False)
    if sb.sparse_attention_enabled:
        log.info("sparse attention on: density %.3f, block %d, backend %s%s%s", sb.density,
                 sb.block_size, sb.attention_backend, ", DST" if sb.dst_enabled else "",
                 ", SAB" if sb.batching_enabled else "")
    log.info("data: %s", corpus)

    model, optimizer, scheduler = setup_model_and_optimizer(
        ModelType.encoder_or_decoder, make_model_provider(args, sb))
    config = get_model_config(model[0])
    timers = MicrobatchTimers()
    config.timers = timers
    config.no_sync_func = model[0].no_sync
    if args.overlap_grad_reduce:
        config.grad_sync_func = model[0].start_grad_sync

    dp = ps.get_data_parallel_world_size()
    num_mb = args.global_batch_size // (args.micro_batch_size * dp)
    capacity = args.seq_length * args.micro_batch_size
    runtime = SparseBalanceRuntime(args, sb, dp=dp, num_microbatches=num_mb, capacity=capacity,
                                   timers=timers)
    config.finalize_model_grads_func = runtime.wrap_finalize(finalize_model_grads)
    batcher = StepBatcher(corpus, capacity=capacity, dp=dp, num_microbatches=num_mb,
                          seed=sb.seed, long_sample_policy=sb.long_sample_policy,
                          packer=runtime.packer())
    batcher.skip(args.iteration)  # resume: same sample order as an uninterrupted run
    return dict(args=args, sb=sb, model=model, optimizer=optimizer, scheduler=scheduler,
                config=config, timers=timers, runtime=runtime, batcher=batcher, corpus=corpus,
                dp=dp, num_microbatches=num_mb, capacity=capacity)


def train(state) -> dict:
    """Run ``--train-iters`` steps; returns the summary (also logged on rank 0)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.training import train_step

    from .cpu_compat import device
    from .data import rank_microbatches

    args, runtime, batcher = state["args"], state["runtime"], state["batcher"]
    model, optimizer, scheduler, config = (state[k] for k in ("model", "optimizer", "scheduler", "config"))
    dp_rank, pp_rank = ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    fb_func = get_forward_backward_func()
    sb = state["sb"]
    forward_step = make_forward_step(sb.straggler_slowdown if dp_rank == sb.straggler_rank else 1.0)
    for m in model:
        m.train()

    history = []
    iteration = args.iteration
    upcoming = batcher.next_step() if iteration < args.train_iters else None
    while iteration < args.train_iters:
        step_data = upcoming
        step_plan = runtime.plan_step(step_data)  # identical on every rank
        budget.set_step_plan(step_plan, dp_rank=dp_rank, stage=pp_rank)
        # Read ahead: the next step's documents are known before this step runs.
        upcoming = batcher.next_step() if iteration + 1 < args.train_iters else None
        state["timers"].reset()
        data_iter = rank_microbatches(step_data, dp_rank, state["corpus"], state["capacity"], device())

        t0 = time.perf_counter()
        out = train_step(forward_step, data_iter, model, optimizer, scheduler, config, fb_func,
                         iteration=iteration)
        comm.barrier()
        step_s = time.perf_counter() - t0
        loss_dict, skipped, grad_norm = out[0], out[1], out[5]
        iteration += 1
        args.iteration = iteration
        args.consumed_train_samples += args.global_batch_size

        loss = loss_dict.get("lm loss") if loss_dict else None
        is_last = ps.is_pipeline_last_stage()
        total = comm.all_reduce_sum([float(loss) if (is_last and loss is not None) else 0.0,
                                     1.0 if (is_last and loss is not None) else 0.0])
        loss_val = total[0] / max(total[1], 1.0)
        tokens = step_data.num_tokens()
        rec = dict(step=iteration, loss=loss_val, step_time_s=step_s, tokens=tokens,
                   split_docs=step_data.split_documents(state["corpus"].lengths, state["capacity"]),
                   tokens_per_s=tokens / step_s,
                   grad_norm=float(grad_norm) if grad_norm is not None else None,
                   skipped=int(skipped))
        rec.update(runtime.end_step(step_data, step_plan, step_s))
        history.append(rec)
        if args.rank == 0 and state["sb"].metrics_file:
            with open(state["sb"].metrics_file, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if args.rank == 0 and (iteration % args.log_interval == 0 or iteration == args.train_iters):
            log.info(_format_step(rec, args.train_iters))
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(iteration, model, optimizer, scheduler, 0)
            runtime.save_state(args.save, iteration)
    if args.save and iteration == args.train_iters and (
            not args.save_interval or iteration % args.save_interval != 0 or iteration == 0):
        save_checkpoint(iteration, model, optimizer, scheduler, 0)
        runtime.save_state(args.save, iteration)
    summary = _summary(history)
    if args.rank == 0 and history:
        log.info("summary: %s", " | ".join(f"{k} {v}" for k, v in summary.items()))
    return dict(history=history, summary=summary)


def _format_step(rec: dict, total: int) -> str:
    parts = [f"step {rec['step']:>4d}/{total}", f"loss {rec['loss']:.4f}",
             f"step {rec['step_time_s']:.3f} s", f"{rec['tokens_per_s']:,.0f} tok/s"]
    if rec.get("grad_norm") is not None:
        parts.append(f"grad {rec['grad_norm']:.3f}")
    if "mean_density" in rec:
        parts.append(f"density {rec['mean_density']:.3f}")
    if "plan" in rec:
        parts.append(rec["plan"])
    if rec.get("split_docs"):
        parts.append(f"split docs {rec['split_docs']}")
    return " | ".join(parts)


def _summary(history: list) -> dict:
    if not history:
        return {}
    steady = history[1:] or history  # the first step pays for warm-up
    mean_s = sum(r["step_time_s"] for r in steady) / len(steady)
    toks = sum(r["tokens"] for r in steady) / sum(r["step_time_s"] for r in steady)
    out = {"steps": len(history), "split_docs": sum(r.get("split_docs", 0) for r in history),
           "first_loss": round(history[0]["loss"], 4),
           "final_loss": round(history[-1]["loss"], 4), "mean_step_s": round(mean_s, 4),
           "tokens_per_s": round(toks, 1)}
    if "mean_density" in history[-1]:
        out["mean_density"] = round(sum(r["mean_density"] for r in steady) / len(steady), 4)
    return out


def main(argv=None) -> dict:
    state = build(argv)
    try:
        out = train(state)
    finally:
        comm.barrier()
    shutdown()
    return out


def shutdown() -> None:
    """Tear the process groups down (after a barrier) while the interpreter is whole. Left to
    exit, a gloo group's worker thread was sometimes destroyed still joinable ("terminate called
    without an active exception", SIGABRT) after a run that had finished and saved, failing the
    launcher."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    comm.destroy()
