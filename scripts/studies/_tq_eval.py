"""``trained_quality``'s evaluation: a run's checkpoint loaded on CPU into megatron-core's
GPTModel with the plugin's sparse attention, and held-out documents scored one at a time (loss,
answer NLL and accuracy, kept density) at each density. The GPU form and ``continued_quality``
score with it too."""

from __future__ import annotations


def checkpoint_arch(args, ckpt: str):
    """The architecture the training flags built, its vocabulary read from the checkpoint."""
    from megatron.core import dist_checkpointing

    from sparsebalance_megatron.megatron.model import hf_convert

    meta = dist_checkpointing.load_tensors_metadata(hf_convert.checkpoint_subdir(ckpt))
    vocab = meta["embedding.word_embeddings.weight"].global_shape[0]
    return hf_convert.HFArchitecture(
        model_type="llama", num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=3 * args.hidden_size, num_attention_heads=args.heads,
        num_query_groups=args.heads // 2, kv_channels=args.hidden_size // args.heads,
        vocab_size=vocab, rotary_base=10000.0, layernorm_epsilon=1e-5, tie_embeddings=False,
        add_qkv_bias=False, max_position_embeddings=args.seq_length)


def load_model(args, ckpt: str, sb):
    from sparsebalance_megatron.megatron.model import hf_convert

    model, _ = hf_convert.load_checkpoint(ckpt, "sparse", sb, expected=checkpoint_arch(args, ckpt))
    return model.requires_grad_(False)


def score_docs(model, budget, docs: list) -> list:
    """Per document (``ids``, the answer's ``answer_at`` and ``answer_len``, or its
    ``answer_positions`` where the answer is not one run of tokens), run alone on the model's
    device: the summed next-token loss and its token count, the answer tokens' mean NLL
    (``answer_nll``), whether every answer token is the teacher-forced argmax (``exact``: what
    greedy decoding emits) and the share that is, and the kept density the sparse attention
    reported (grad mode on, though no weight needs grad: the budget then records what it
    kept). The GPU form and ``continued_quality`` score with it too."""
    import torch
    import torch.nn.functional as F

    dev = next(model.parameters()).device
    rows = []
    budget.pop_stats()
    for doc in docs:
        ids = torch.tensor([doc["ids"]], device=dev)
        pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
        with torch.enable_grad():
            logits = model(ids, pos, attention_mask=None)[0].float()     # [s, V]
        stats = budget.pop_stats()
        at = doc.get("answer_positions") or range(doc["answer_at"],
                                                  doc["answer_at"] + doc["answer_len"])
        at = torch.tensor(list(at), device=dev)
        right = (logits[at - 1].argmax(-1) == ids[0, at]).tolist()
        rows.append({"nll": float(F.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")),
                     "tokens": ids.shape[1] - 1, "exact": float(all(right)),
                     "answer_nll": float(F.cross_entropy(logits[at - 1], ids[0, at])),
                     "token_accuracy": sum(right) / len(right),
                     "kept": sum(st[3][0] for st in stats) / max(1, len(stats))})
    return rows


def score_densities(model, budget, sb, docs: list, densities, depths, group=None) -> dict:
    """Per density (the budget's and ``sb``'s default, set in turn): held-out LM loss, answer
    accuracy (exact and per token) overall and by ``depths`` (each doc's ``depth``), and kept
    density; ``group``: a key of the docs whose values get their own accuracy
    (``accuracy_by_<group>``). The GPU form scores with it too."""
    out = {}
    for d in densities:
        sb.density = budget.default_density = d
        rows = score_docs(model, budget, docs)
        by_depth = {}
        for depth in depths:
            rs = [r for r, doc in zip(rows, docs) if doc["depth"] == depth]
            by_depth[f"{depth:g}"] = {"accuracy": sum(r["exact"] for r in rs) / len(rs),
                                      "token_accuracy": sum(r["token_accuracy"] for r in rs)
                                      / len(rs), "n": len(rs)}
        out[f"{d:g}"] = {"heldout_loss": sum(r["nll"] for r in rows)
                         / sum(r["tokens"] for r in rows),
                         "accuracy": sum(r["exact"] for r in rows) / len(rows),
                         "token_accuracy": sum(r["token_accuracy"] for r in rows) / len(rows),
                         "accuracy_by_depth": by_depth,
                         "eval_kept_density": sum(r["kept"] for r in rows) / len(rows)}
        if group is not None:
            rs = {}
            for r, doc in zip(rows, docs):
                rs.setdefault(doc[group], []).append(r["exact"])
            out[f"{d:g}"][f"accuracy_by_{group}"] = {g: sum(x) / len(x) for g, x in rs.items()}
    return out
