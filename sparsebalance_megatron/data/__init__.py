"""Real-data pipeline: offline tokenizers, the cached document corpus, sampling and packing.

Pure: numpy and tokenizers only; no torch.distributed, no megatron (a Megatron indexed data set
is parsed with numpy, ``indexed.py``).
"""

from .corpus import (DataError, DataFileNotFoundError, DocumentCorpus, format_stats,
                     length_stats, load_corpus, pad_vocab_size)
from .packing import (PAD_SEQ_TOKENS, GlobalBatchSampler, LongDocumentError, PackedMicroBatch,
                      Segment, materialize, packed_length, padding_lengths, sequential_pack)
from .tokenizers import TOKENIZER_NAMES, TokenizerUnavailableError, get_tokenizer

__all__ = [
    "DataError", "DataFileNotFoundError", "DocumentCorpus", "format_stats", "length_stats",
    "load_corpus", "pad_vocab_size", "GlobalBatchSampler", "LongDocumentError",
    "PackedMicroBatch", "Segment", "materialize", "sequential_pack", "padding_lengths",
    "packed_length",
    "PAD_SEQ_TOKENS", "TOKENIZER_NAMES",
    "TokenizerUnavailableError", "get_tokenizer",
]
