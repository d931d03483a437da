"""sparsebalance_megatron: SparseBalance (arXiv 2604.13847) for Megatron-LM.

Budgeted block-sparse attention whose density is a load-balancing knob: dynamic sparsity
tuning (DST) and sparsity-aware batching (SAB) on top of a profiled latency model.
Importing the package needs neither megatron, a GPU, nor an optional accelerator.
"""

from .arguments import add_sparsebalance_args, config_from_args
from .config import ConfigError, SparseBalanceConfig

__version__ = "0.3.0"
__all__ = ["SparseBalanceConfig", "ConfigError", "add_sparsebalance_args", "config_from_args"]
