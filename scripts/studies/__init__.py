"""The named studies of ``scripts/bench.py``: one module each, with ``main(argv) -> int``.

Every study writes its JSON through ``common.write_result``, which records the command, commit,
versions and device. Run them through the runner (``python scripts/bench.py NAME --help``); a
study is not a script of its own.
"""
