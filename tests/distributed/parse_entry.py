"""What a training entry runs first, alone: the plugin's ``args_defaults`` (evaluated before
Megatron parses a flag), so that a refusal of a bad flag can be launched under torchrun without
importing megatron-core (tests/distributed/test_edges.py)."""

from sparsebalance_megatron.megatron import hooks

if __name__ == "__main__":
    hooks.args_defaults(packed_data=True)
    print("[test] the flags passed", flush=True)
