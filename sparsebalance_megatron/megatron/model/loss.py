"""The loss of a packed micro-batch: Megatron-LM's ``pretrain_gpt.loss_func``, mirrored.

``loss_func`` lives in Megatron-LM's ``pretrain_gpt.py``, a script that the megatron-core wheel
does not ship, so the plugin cannot call it; it mirrors it instead, flag by flag.
``MEGATRON_LOSS_ARGS`` lists every argument that ``loss_func`` reads (core_r0.19.0 and main,
megatron-core 0.19.2 and 0.20.0) and what the plugin does with it: mirrored here, or refused at
launch (``launch/checks.py``) where the plugin's forward step cannot honour it.
``tests/unit/test_loss_mirror.py`` reads ``loss_func`` of a Megatron-LM checkout and fails when
it reads an argument this table does not name.

Besides Megatron's contract (sum, tokens, report) the loss records each document's loss sum and
tokens for the sensitivity signal, without a host sync.
"""

from __future__ import annotations

import functools

import torch

# pretrain_gpt.py: "define spiky loss as a loss that's 10x the max loss observed"
SPIKY_LOSS_FACTOR = 10

# Every ``args.<name>`` that pretrain_gpt.loss_func reads -> how the plugin honours it.
MEGATRON_LOSS_ARGS = {
    "check_for_nan_in_loss_and_grad": "mirrored: NaN or Inf in the local loss is fatal",
    "check_for_spiky_loss": f"mirrored: a loss {SPIKY_LOSS_FACTOR}x the largest seen is reported",
    "logits_load_dir": "refused with the plugin's data path (offline distillation loss)",
    "logits_load_decode_threads": "read only with --logits-load-dir (refused)",
    "logits_load_prefetch_factor": "read only with --logits-load-dir (refused)",
    "logits_load_msc_prefetch_depth": "read only with --logits-load-dir (refused)",
    "logits_load_kd_loss_alpha": "read only with --logits-load-dir (refused)",
    "logits_load_ignore_errors": "read only with --logits-load-dir (refused)",
    "modelopt_enabled": "refused with the plugin's data path (ModelOpt's distillation loss)",
}


def loss_func(loss_mask, psp, callback, args, output_tensor):
    """Megatron's per-token loss contract: (sum, tokens, report), with pretrain_gpt's checks;
    ``callback`` records the loss and, with the loss signal, each document's sums."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=reject,
                                    message=f"found {what} in local forward loss calculation",
                                    tolerance=0.0, fatal=True)
    if getattr(args, "check_for_spiky_loss", False):
        machine.validate_result(
            result=loss, rejection_func=functools.partial(
                machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)
    callback.record_loss(loss, num_tokens)
    docs = getattr(psp, "sb_doc_ids", None)
    if docs and callback.signal == "loss":
        # this rank's tokens: its share of every sequence under CP, padding included
        callback.record_doc_losses(docs, *document_sums(losses * mask, mask,
                                                        psp.local_cu_seqlens(), len(docs)))
    return loss, num_tokens, report


def document_sums(values, mask, cu_seqlens, n_docs: int):
    """(sum of ``values``, sum of ``mask``) over each of the first ``n_docs`` sequences of a
    packed micro-batch ([T] each, boundaries ``cu_seqlens``): prefix sums read at the
    boundaries, on the device."""
    cu = cu_seqlens.long()
    zero = values.new_zeros(1)
    csum = torch.cat([zero, torch.cumsum(values, 0)])
    cmask = torch.cat([zero, torch.cumsum(mask, 0)])
    lo, hi = cu[:n_docs], cu[1:n_docs + 1]
    return csum[hi] - csum[lo], cmask[hi] - cmask[lo]
