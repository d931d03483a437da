"""Long-context quality eval: RULER-style task generator and scoring (issue 7).

The generator, scoring and the quality studies' verdict (``verdict.py``: non-inferiority at
matched kept density with a positive control, issue 73) are pure Python (no torch); ``recall.py`` (mass recall of block
selections against exact attention) needs torch and is imported explicitly. Nothing here may import
megatron or transformers: conversion lives in ``megatron/model/hf_convert.py``, the Megatron forward
and its attention hooks in ``scripts/bench.py long_context``.
"""

from .assets import HAYSTACKS, MissingDataPackageError, lce_json_dir
from .scoring import answer_token_accuracy, greedy_exact_match, mean_by, string_match
from .tasks import (TASKS, TEXT_SOURCES, TaskLengthError, TaskSample, make_sample, make_suite,
                    make_text_window)

__all__ = ["TASKS", "TEXT_SOURCES", "make_text_window", "HAYSTACKS", "TaskSample", "TaskLengthError", "MissingDataPackageError",
           "make_sample", "make_suite", "lce_json_dir", "answer_token_accuracy",
           "greedy_exact_match", "string_match", "mean_by"]
