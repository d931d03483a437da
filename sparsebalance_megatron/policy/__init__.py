"""Pure budget policies: dynamic sparsity tuning (DST).

Plain arrays in, densities out; identical inputs give identical plans on every rank.
Must not import torch, megatron or torch.distributed.
"""

from .costs import GRID_STEP, UnitCosts, check_density_bounds, density_grid
from .density_means import weighted_mean_density
from .dst_band import DSTPlan, DSTReport
from .dst_rounds import plan_dst
from .dst_settings import DSTSettings, dst_inputs

__all__ = ["GRID_STEP", "UnitCosts", "check_density_bounds", "density_grid",
           "weighted_mean_density", "DSTPlan", "DSTReport", "DSTSettings", "dst_inputs",
           "plan_dst"]
