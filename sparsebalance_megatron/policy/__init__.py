"""Pure budget policies: dynamic sparsity tuning (DST).

Plain arrays in, densities out; identical inputs give identical plans on every rank.
Must not import torch, megatron or torch.distributed.
"""

from .costs import (GRID_STEP, UnitCosts, check_density_bounds, density_grid,
                    weighted_mean_density)
from .dst import (DSTPlan, DSTReport, check_anchor_tolerance, plan_dst, plan_dst_from_config,
                  plan_dst_with_floor, static_plan)
from .dst_settings import DSTSettings

__all__ = ["GRID_STEP", "UnitCosts", "check_density_bounds", "density_grid",
           "weighted_mean_density", "DSTPlan", "DSTReport", "DSTSettings",
           "check_anchor_tolerance", "plan_dst", "plan_dst_from_config", "plan_dst_with_floor",
           "static_plan"]
