"""The training entry's --help lists Megatron's flags and ours (megatron-core 0.19.2's own help
text has a stray '%' that crashes argparse; the entry escapes it)."""

import subprocess
import sys

from tests.conftest import ENTRY


def test_entry_help_lists_megatron_and_sparsebalance_flags(tmp_path):
    """Without reading any data: the built-in corpus (the default data, whose vocabulary a run
    takes) is not tokenized for the help (seconds on a machine that has not cached it)."""
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, str(ENTRY), "--help", "--sb-data-cache-dir", cache],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert not cache.exists() or not list(cache.iterdir()), list(cache.iterdir())
    for flag in ("--num-layers", "--pipeline-model-parallel-size", "--sparse-balance",
                 "--sb-density", "--sb-anchor", "--sb-latency-table"):
        assert flag in proc.stdout
    assert "less 10% (at least 2 s)" in " ".join(proc.stdout.split())   # a plain % in a help
