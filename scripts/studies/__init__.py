"""The named studies of ``scripts/bench.py``: one module each, with ``main(argv) -> int``."""
