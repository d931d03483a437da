"""The training entry's --help lists Megatron's flags and ours (megatron-core 0.19.2's own help
text has a stray '%' that crashes argparse; the entry escapes it)."""

from tests.conftest import run_entry


def test_entry_help_lists_megatron_and_sparsebalance_flags(tmp_path):
    """Without reading any data: the built-in corpus (the default data, whose vocabulary a run
    takes) is not tokenized for the help (seconds on a machine that has not cached it)."""
    cache = tmp_path / "cache"      # one rank, forked where megatron-core is imported already
    proc = run_entry(1, ["--help", "--sb-data-cache-dir", cache], cwd=tmp_path)
    assert not cache.exists() or not list(cache.iterdir()), list(cache.iterdir())
    for flag in ("--num-layers", "--pipeline-model-parallel-size", "--sparse-balance",
                 "--sb-density", "--sb-anchor", "--sb-latency-table"):
        assert flag in proc.stdout
    assert "less 10% (at least 2 s)" in " ".join(proc.stdout.split())   # a plain % in a help
