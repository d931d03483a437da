"""Every flag that names a file or directory is checked at launch, the error naming the flag.

The flags are the config fields declared with a ``path`` kind (``config.path_fields``); a string
field that names a path without declaring it fails ``test_every_path_flag_is_declared``, and an
input file flag without a content reader fails the unreadable-content cases here.
"""

from __future__ import annotations

import dataclasses

import pytest

from sparsebalance_megatron.config import SparseBalanceConfig, flag_name, path_fields
from sparsebalance_megatron.megatron.launch.checks import LaunchError
from sparsebalance_megatron.megatron.launch.preflight import check_config

NOT_PATHS = {"fault", "raise_headroom", "dense_below_tokens", "watchdog_seconds",
             "microbatch_multiple", "exchange_rate"}   # strings that name no file


def test_every_path_flag_is_declared():
    strings = [f.name for f in dataclasses.fields(SparseBalanceConfig)
               if f.type in ("Optional[str]", "str") and "choices" not in f.metadata]
    undeclared = [n for n in strings if n not in NOT_PATHS and "path" not in
                  SparseBalanceConfig.__dataclass_fields__[n].metadata]
    assert undeclared == [], f"string flags that name no path kind: {undeclared}"
    assert set(path_fields("input")) >= {"latency_table", "quality_cost", "replay_plans"}
    assert set(path_fields("output")) >= {"metrics_file"}
    assert set(path_fields("directory")) >= {"data_cache_dir"}


def _refusal(**kw) -> str:
    # --sparse-balance with the quality objective: the run reads every input file flag
    with pytest.raises(LaunchError) as e:
        check_config(SparseBalanceConfig(sparse_balance=True, **kw))
    return str(e.value)


def _bad_input(kind: str, tmp_path):
    if kind == "directory":
        return tmp_path, "is a directory"
    if kind == "missing":
        return tmp_path / "none.json", "file not found"
    path = tmp_path / "bad.json"
    if kind == "not-json":
        path.write_text('{"truncated": ')
        return path, "JSON"
    path.write_bytes(b"\xff\xfe\x00garbage")
    return path, "UTF-8"


@pytest.mark.parametrize("kind", ["directory", "missing", "not-json", "not-text"])
@pytest.mark.parametrize("name", path_fields("input"))
@pytest.mark.reliability(area="plugin flags", case="every input file flag (--sb-latency-table, "
                         "--sb-quality-cost, --sb-replay-plans): a directory, a missing file, "
                         "truncated JSON, binary bytes", expect="refused at launch in one line "
                         "naming the flag and the path")
def test_a_bad_input_file_is_refused_naming_its_flag(name, kind, tmp_path):
    path, what = _bad_input(kind, tmp_path)
    msg = _refusal(**{name: str(path)})
    assert msg.startswith(flag_name(name)) and str(path) in msg and what in msg, msg
    assert "Errno" not in msg, msg


@pytest.mark.parametrize("name", path_fields("output"))
@pytest.mark.reliability(area="plugin flags", case="every output file flag (--sb-metrics-file): "
                         "its directory missing, or a directory", expect="refused at launch "
                         "naming the flag and the path, before step 1")
def test_a_bad_output_file_is_refused_naming_its_flag(name, tmp_path):
    missing = tmp_path / "no" / "dir" / "out.jsonl"
    msg = _refusal(**{name: str(missing)})
    assert msg.startswith(f"{flag_name(name)} {missing}: directory") and "does not exist" in msg
    assert _refusal(**{name: str(tmp_path)}).startswith(f"{flag_name(name)} {tmp_path}: is a "
                                                        f"directory")


@pytest.mark.parametrize("name", path_fields("directory"))
@pytest.mark.reliability(area="plugin flags", case="every output directory flag "
                         "(--sb-data-cache-dir) naming a file, or under one", expect="refused at "
                         "launch naming the flag and the path")
def test_a_bad_output_directory_is_refused_naming_its_flag(name, tmp_path):
    afile = tmp_path / "f"
    afile.write_text("x")
    assert _refusal(**{name: str(afile)}).startswith(f"{flag_name(name)} {afile}: exists and is "
                                                     f"not a directory")
    assert f"{flag_name(name)} {afile / 'sub'}: cannot be created" in \
        _refusal(**{name: str(afile / "sub")})


@pytest.mark.reliability(area="plugin flags", case="no --sb-latency-table (the run profiles one "
                         "at start-up) and the default cache directory cannot be created",
                         expect="refused at launch naming --sb-data-cache-dir and the path")
def test_the_start_up_profile_cache_is_checked_at_launch(tmp_path, monkeypatch):
    import sparsebalance_megatron.data.sources as sources

    afile = tmp_path / "home-is-a-file"
    afile.write_text("x")
    monkeypatch.setattr(sources, "default_cache_dir", lambda: str(afile / "cache"))
    msg = _refusal()
    assert msg.startswith("--sb-data-cache-dir (default, the start-up latency profile's cache) "
                          f"{afile / 'cache'}: cannot be created"), msg
    check_config(SparseBalanceConfig(sparse_balance=True, data_cache_dir=str(tmp_path / "c")))
    check_config(SparseBalanceConfig(sparse_attention=True))      # static: no profile
