"""A step's own micro-batch count (Megatron's ``dp_balanced``), through Megatron's calculator.

With ``--sb-stand-down dp_balanced`` a step may commit Megatron's dp_balanced packing of its
documents (``step/drafting.py``): its own micro-batch count per DP rank (8 or 12 where the other
packings have 8, say), each micro-batch its documents only. Megatron's ``train()`` runs as many
micro-batches as its micro-batch calculator says (``megatron.core.num_microbatches_calculator``:
``train_step`` passes ``get_num_microbatches()`` to the schedule), so the plugin wraps the
calculator Megatron built (``StepMicrobatches``), changing nothing else:

- Megatron's own count stays what the loop sees at every other point: its "the count never
  falls" assertion and checkpoint on a change (megatron-core 0.19.2's ``train()``), the consumed
  samples it adds after the step and the learning-rate schedule's increment. A step consumes
  the samples (bins) its documents were drawn from, dp x Megatron's count, whatever packing
  ran them (``PreparedStep.consumed_samples``): the data position, resume and the schedule
  are those of a fixed-count run.
- Between the loop's consistency-checked ``update`` for a step's consumed samples (the last
  call before ``train_step``, after the unchecked one that opens the iteration; the checked
  call of a checkpoint's load arms nothing) and that step's end (``finalize_model_grads``)
  ``get`` is the committed packing's count, so the schedule runs exactly its micro-batches;
  the loss is normalised per token (the plugin sets ``calculate_per_token_loss``).

``end_step`` checks that the schedule ran the committed count (a Megatron whose loop calls the
calculator otherwise is stopped, named, at the first such step). Only a run that can commit
dp_balanced installs the wrapper: every other run keeps Megatron's calculator as built.
"""

from __future__ import annotations


def own_length_multiple(args, sb) -> int:
    """What a micro-batch of its documents only (Megatron's dp_balanced) is rounded up to: the
    run's ``--sb-microbatch-multiple`` where it varies lengths, else what the document padding
    and sequence parallelism need (``launch.lengths.length_need``)."""
    from ..launch.lengths import length_need

    return int(sb.length_multiple or length_need(args, sb))


def megatron_count() -> int:
    """Megatron's own micro-batch count now (its calculator's, past the wrapper)."""
    from megatron.core import num_microbatches_calculator as nmc

    calc = nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    return (calc.inner if isinstance(calc, StepMicrobatches) else calc).get()


def install(callback) -> "StepMicrobatches":
    """Wrap Megatron's micro-batch calculator so that ``callback``'s committed steps set the
    count their schedule runs (idempotent)."""
    from megatron.core import num_microbatches_calculator as nmc

    inner = nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if isinstance(inner, StepMicrobatches):
        inner = inner.inner
    if inner is None:
        raise RuntimeError("Megatron's micro-batch calculator is not built yet "
                           "(initialize_megatron builds it before the model)")
    nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR = StepMicrobatches(inner, callback)
    return nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR


class StepMicrobatches:
    """Megatron's calculator ``inner`` (its ``NumMicroBatchesCalculator`` interface), whose
    ``get`` is the committed step's count while that step runs (module docstring); everything
    else is ``inner``'s."""

    def __init__(self, inner, callback):
        self.inner, self.callback = inner, callback
        self._opened = None         # consumed samples of the iteration train() opened
        self._armed = None          # consumed samples of the step the loop is about to run

    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        self.inner.update(consumed_samples, consistency_check, verbose)
        # train() opens an iteration with update(consistency_check=False) and calls
        # update(True) last before train_step, both at the same consumed samples; a lone
        # update(True) (a checkpoint's load) arms nothing
        consumed = int(consumed_samples)
        if consistency_check:
            self._armed = consumed if self._opened == consumed else None
            self._opened = None
        else:
            self._opened, self._armed = consumed, None

    def get(self) -> int:
        if self._armed is not None:
            m = self.callback.microbatches_at(self._armed)
            if m is not None:
                return m
        return self.inner.get()

    def get_current_global_batch_size(self) -> int:
        return self.inner.get_current_global_batch_size()

    def get_micro_batch_size(self) -> int:
        return self.inner.get_micro_batch_size()

    def get_current_running_global_batch_size(self) -> int:
        return self.inner.get_current_running_global_batch_size()
