"""The quality model follows the network in training (``--sb-quality-refresh-interval N``).

Every N-th iteration (not the last: no plan would read it), at the step's end, before the next
step's draft, every rank runs forward-only passes of a fixed held-out batch of K micro-batches per
DP rank (``--sb-quality-refresh-microbatches K``) through Megatron's own schedule
(``get_forward_backward_func()`` with ``forward_only=True`` and ``num_microbatches=K``, models in
evaluation mode, no gradient, Megatron's timers and result validation off: as its ``evaluate()``
runs them): once at uniform d0 and once per depth group of the quality model with that group's
layers at ``quality.refresh.probe_density(d0)`` (the attention reads them as the budget context's
per-layer densities: the batch is outside any plan), K x (1 + groups) micro-batch forwards in all.
The last pipeline stage sums each document's loss per pass; the sums travel to the other stages (a
broadcast over the pipeline group) and over the DP group (an all-reduce), so every rank holds the
same per-group loss change and its standard error over the documents, and computes the same scales
(``quality.refresh.refresh_scales``, relative to the launch-time model, the product of every
refresh's). The drafts made after it plan with them (``Drafter``'s ``quality_scales``, sent to the
planner process with each request).

The held-out batch is the valid split's first K rows of DP bins, each packed as Megatron's
evaluation packs it (``data.held_out_batch``); the same every refresh, so refreshes compare the
network with itself. The change's standard error is over the batch's documents: a batch of one
document has none (inf) and moves no scale, and its refresh's line says so and names the flag. The
refresh's wall seconds count in the step's plugin overhead and are reported as the metrics'
``quality_refresh_s``. A measurement the policy refuses (the model predicts no change) costs the
refresh, not the run: the scales stay as they were and one line says why.

Imports megatron (its schedule) only inside the refresh; torch.distributed only through comm.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Optional

import numpy as np
import torch

from ...config import flag_name
from ...quality.refresh import MAX_SCALE
from ..runtime import comm

HEAD = 4                  # tokens, documents, sum of tokens^2, loss sum at d0
STATS = 3                 # per group's pass: its documents' loss-sum changes summed, squared,
                          # times their tokens


class QualityProbe:
    """One rank's part of the refresh: ``due(iteration)``, then ``refresh(iteration)``
    (collective: every rank of the job, in the same iterations)."""

    def __init__(self, sb, args, *, model: list, forward_step: Callable, budget, exchange,
                 held_out: list, lengths: np.ndarray, pp_rank: int):
        from ...quality.cost import load_quality_cost
        from ...quality.refresh import group_of_layer

        self.sb, self.args, self.model, self.forward_step = sb, args, model, forward_step
        self.budget, self.exchange = budget, exchange
        self.held_out = list(held_out)          # this DP rank's K micro-batches
        self.lengths = np.asarray(lengths, dtype=np.float64)   # the whole batch's documents
        self.last = pp_rank == exchange.sizes[1] - 1
        self.base = load_quality_cost(sb.quality_cost)
        layers = int(args.num_layers)
        self.groups = [group_of_layer(self.base, n, layers) for n in range(1, layers + 1)]
        self.scales: Optional[tuple] = None     # the product of every refresh's; None: none yet

    def due(self, iteration: int) -> bool:
        """Whether the end of 0-based ``iteration`` refreshes: every N-th, not the last."""
        n = self.sb.quality_refresh_interval
        return bool(n) and (iteration + 1) % n == 0 and iteration + 1 < self.args.train_iters

    def refresh(self, iteration: int) -> dict:
        """Measure, agree, rescale (collective); the metrics' fields of this refresh."""
        from ...quality.cost import QualityCostError
        from ...quality.refresh import probe_density, refresh_scales, scaled

        t0 = time.perf_counter()
        d0, g = self.sb.density, len(self.base.groups)
        tested = probe_density(d0)
        stats = self._measure([None] + [{n + 1: tested for n, k in enumerate(self.groups)
                                         if k == grp} for grp in range(g)])
        change, se, base_loss = changes(stats, g)
        documents = int(stats[1])
        current = self.base if self.scales is None else scaled(self.base, self.scales)
        line = f"quality refresh at iteration {iteration + 1}: "
        try:
            step = refresh_scales(current, d0, [tested] * g, change, se, lengths=self.lengths,
                                  tokens=self.lengths)
            total = np.clip(step * (1.0 if self.scales is None else np.asarray(self.scales)),
                            1.0 / MAX_SCALE, MAX_SCALE)
            self.scales = tuple(float(x) for x in total)
            said = f"group scales {_fmt(self.scales)}"
        except QualityCostError as e:             # the same on every rank: the same inputs
            said = f"not applied ({e}); group scales stay {_fmt(self.scales or (1.0,) * g)}"
        if documents < 2:                         # no spread: the error is inf, nothing moved
            said += (f" (the held-out batch holds {documents} document(s) in all: no spread to "
                     f"measure the change's error by, so no scale moves; give "
                     f"{flag_name('quality_refresh_microbatches')} more micro-batches)")
        self._check_agreed(iteration)
        cost = time.perf_counter() - t0
        comm.say(f"{line}{said}; measured loss change {_fmt(change)} +- {_fmt(se)} nats/token "
                 f"at density {tested:g} (held-out loss {base_loss:.4f}); cost {cost:.3f} s")
        return {"quality_refresh_s": cost, "quality_scales": list(self.scales or (1.0,) * g),
                "quality_refresh_change": [float(x) for x in change]}

    def _check_agreed(self, iteration: int) -> None:
        """Every rank holds the same scales (one max over the pipeline and DP groups of them
        and their negatives): the same plans need the same model on every rank."""
        mine = np.asarray(self.scales or (1.0,) * len(self.base.groups), dtype=np.float64)
        t = torch.from_numpy(np.concatenate([mine, -mine]))
        for group in (self.exchange.groups.pipeline, self.exchange.groups.data):
            t = comm.all_reduce_tensor(t, group, "max")
        hi, lo = t.numpy()[:mine.size], -t.numpy()[mine.size:]
        if not (np.array_equal(hi, mine) and np.array_equal(lo, mine)):
            raise RuntimeError(f"iteration {iteration + 1}: the quality refresh's scales differ "
                               f"between ranks (this rank {mine.tolist()}, the ranks' range "
                               f"{lo.tolist()} .. {hi.tolist()}): the refresh must be "
                               f"deterministic on every rank")

    def _measure(self, settings: list) -> np.ndarray:
        """The passes' statistics (``changes`` reads them) summed over the DP group, on every
        rank: [tokens, documents, sum of tokens^2, loss sum at d0] and per later pass (sum,
        sum of squares, sum x tokens) of each document's loss-sum change against the first."""
        with _evaluating(self.model):
            per_pass = [self._pass(s) for s in settings]        # last stage: [n_docs, 2] each
        self.budget.pop_stats()           # what the attention recorded of these passes
        self.budget.pop_served()
        row = pass_stats(per_pass) if self.last else \
            np.zeros(HEAD + STATS * (len(settings) - 1))
        t = torch.from_numpy(row)
        t = comm.broadcast_tensor(t, self.exchange.groups.pipeline, self.exchange.sizes[1] - 1)
        return comm.all_reduce_tensor(t, self.exchange.groups.data, "sum").numpy()

    def _pass(self, layer_densities: Optional[dict]) -> np.ndarray:
        """One forward-only pass of the held-out batch (its K micro-batches) under
        ``layer_densities``: [n_docs, 2] (loss sum, loss tokens) per document of every
        micro-batch in order on the last stage, else empty."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        docs: list = []
        before = self.budget.layer_densities
        self.budget.set_layer_densities(layer_densities)
        try:
            get_forward_backward_func()(
                forward_step_func=functools.partial(_probe_step, self.forward_step, docs),
                data_iterator=iter(self.held_out), model=self.model,
                num_microbatches=len(self.held_out),
                seq_length=self.args.seq_length, micro_batch_size=self.args.micro_batch_size,
                decoder_seq_length=self.args.decoder_seq_length, forward_only=True)
        finally:
            self.budget.set_layer_densities(before)
        return np.concatenate(docs) if docs else np.zeros((0, 2))


def _probe_step(forward_step: Callable, docs: list, data_iterator, model, *args, **kw):
    """The run's forward step on the batch's next micro-batch (drawn here: the loss function
    reads its documents), its loss function also keeping each document's (loss sum, tokens)
    of the pass (``model.loss.document_sums``)."""
    mb = next(data_iterator)
    output, loss = forward_step(iter([mb]), model)

    def with_docs(output_tensor):
        from ..model.loss import document_sums

        out = loss(output_tensor)
        psp, mask = mb["packed_seq_params"], mb["loss_mask"].view(-1).float()
        s, n = document_sums(output_tensor.float().view(-1) * mask, mask,
                             psp.local_cu_seqlens(), len(psp.sb_doc_ids))
        docs.append(torch.stack([s, n], dim=1).double().cpu().numpy())
        return out
    return output, with_docs


@contextlib.contextmanager
def _evaluating(model: list):
    """As Megatron's ``evaluate()`` runs its passes: the model chunks in evaluation mode (no
    dropout), no gradient, Megatron's timers off (the step's own are still running: the
    refresh runs inside its ``finalize_model_grads``) and its result validation off; all
    restored after."""
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
    from megatron.core.utils import get_model_config

    config, machine = get_model_config(model[0]), get_rerun_state_machine()
    timers, mode = config.timers, machine.get_mode()
    for m in model:
        m.eval()
    config.timers = None
    machine.set_mode(RerunMode.DISABLED)
    try:
        with torch.no_grad():
            yield
    finally:
        machine.set_mode(mode)
        config.timers = timers
        for m in model:
            m.train()


def pass_stats(per_pass: list) -> np.ndarray:
    """The statistics ``changes`` reads of one rank's documents, a sum over documents (so
    over ranks too): ``per_pass`` [passes] of [n_docs, 2] (loss sum, loss tokens), the first
    at uniform d0, one per depth group after it."""
    first, tokens = per_pass[0][:, 0], per_pass[0][:, 1]
    row = np.zeros(HEAD + STATS * (len(per_pass) - 1))
    row[:HEAD] = tokens.sum(), float(tokens.size), (tokens * tokens).sum(), first.sum()
    for k, sums in enumerate(per_pass[1:]):
        diff = sums[:, 0] - first
        row[HEAD + STATS * k:HEAD + STATS * (k + 1)] = (diff.sum(), (diff * diff).sum(),
                                                        (diff * tokens).sum())
    return row


def changes(stats: np.ndarray, groups: int) -> tuple:
    """(per-token loss change [G], its standard error [G], the held-out loss at d0) from the
    summed statistics (``pass_stats``): a ratio of sums over documents, its error the ratio
    estimator's, sqrt(n / (n - 1) sum over documents of (diff_d - c t_d)^2) / tokens (inf with
    one document: no spread to measure, so nothing is known of the change's error and it moves
    no scale; one document's change taken as it is swung the scales 0.25-0.96 between refreshes
    of a continued-training run)."""
    tokens, n, t2, first = stats[:HEAD]
    tokens = max(tokens, 1.0)
    change, se = np.zeros(groups), np.zeros(groups)
    for g in range(groups):
        d, d2, dt = stats[HEAD + STATS * g:HEAD + STATS * (g + 1)]
        c = d / tokens
        resid = max(d2 - 2.0 * c * dt + c * c * t2, 0.0)
        change[g] = c
        se[g] = np.sqrt(resid * n / (n - 1.0)) / tokens if n >= 2 else np.inf
    return change, se, first / tokens


def _fmt(values) -> str:
    return "[" + ", ".join(f"{float(v):.4g}" for v in values) + "]"
