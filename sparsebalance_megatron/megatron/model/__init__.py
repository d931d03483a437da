"""The adapter's ``model`` room: what Megatron builds with the plugin: layer and hybrid stack specs,
the sparse and dense core attentions, the budget context they read (``budget``), context parallel
attention, the loss, the check that the built model runs our attention, Hugging Face conversion
(and a GGUF's tensors packed for a machine without the GGUF reader: ``gguf_weights``).

Modules: ``attention_check``, ``budget``, ``context_parallel``, ``core_attention``,
``dense_attention``, ``gguf_weights``, ``hf_convert``, ``hybrid``, ``loss``, ``spec``. May import:
``errors``, ``runtime`` (and megatron and the pure layers); never a room after it (docs/DESIGN.md
section 2). Its exports: ``_PUBLIC`` (``lazy_exports``).
"""

from .. import lazy_exports

_PUBLIC = {
    "check_sparse_attention": "attention_check",
    "BudgetContext": "budget",
    "SparsePackedSeqParams": "budget",
    "SparseCoreAttention": "core_attention",
    "DenseVarlenCoreAttention": "dense_attention",
    "load_hf_gguf": "hf_convert",
    "install_attention_spec": "hybrid",
    "is_hybrid_config": "hybrid",
    "loss_func": "loss",
    "get_sparsebalance_layer_spec": "spec",
    "sparse_core_attention_spec": "spec",
}
__all__, __getattr__ = lazy_exports(__name__, _PUBLIC)
