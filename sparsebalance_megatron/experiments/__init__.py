"""Simulated studies built on the policies: the variant study of the benchmarks and the pipeline
layout search of ``sparsebalance-layout``. They call the runtime's own policy functions
(``plan_dst``, SAB, the latency model), so what they measure is what trains.

Pure numpy; must not import torch or megatron.
"""

from .layout_search import LayoutChoice, best_layouts, search_layouts
from .study import StudyConfig, format_table, run_config, run_study

__all__ = ["LayoutChoice", "best_layouts", "search_layouts", "StudyConfig", "format_table",
           "run_config", "run_study"]
