"""--sb-packing picks the data path's packer; 'auto' follows the SAB switch."""

import pytest

from sparsebalance_megatron.config import ConfigError, SparseBalanceConfig


@pytest.mark.parametrize("kw, method", [
    ({}, "sequential"),
    ({"sparse_balance": True}, "sab"),
    ({"batching": True}, "sab"),
    ({"sparse_balance": True, "packing": "sequential"}, "sequential"),
    ({"packing": "token_balanced"}, "token_balanced"),
    ({"packing": "sab"}, "sab"),
])
def test_packing_method(kw, method):
    cfg = SparseBalanceConfig(**kw)
    assert cfg.packing_method == method
    assert cfg.batching_enabled == (method == "sab" or kw.get("sparse_balance", False)
                                    or kw.get("batching", False))


def test_unknown_packing_names_the_flag():
    with pytest.raises(ConfigError, match="--sb-packing='lpt'"):
        SparseBalanceConfig(packing="lpt")
