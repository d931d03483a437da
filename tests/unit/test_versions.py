"""The megatron-core versions the suite ran on are the range setup.py declares, and a launch on
another version names the installed and the tested versions, once.

To run the suite against megatron-core 0.20 (Megatron-LM main, not on PyPI yet), see README
"Install next to Megatron": ``SB_MEGATRON_CORE_020=DIR`` (tests/conftest.py).
"""

from __future__ import annotations

from sparsebalance_megatron.megatron.launch import compat


def test_untested_megatron_core_is_named_once(monkeypatch, capsys):
    assert compat.untested_versions_warning("0.19.2") is None
    assert compat.untested_versions_warning("0.20.0+d98e8a64dd") is None    # a checkout's
    msg = compat.untested_versions_warning("0.21.0rc1")
    assert msg == ("warning: megatron-core 0.21.0rc1 is installed; sparsebalance_megatron was "
                   "tested with megatron-core 0.19.2 and 0.20.0 (setup.py: "
                   "megatron-core>=0.19.2,<0.21)")
    import megatron.core
    monkeypatch.setattr(megatron.core, "__version__", "0.21.0rc1")
    monkeypatch.setattr(compat, "_warned_versions", False)
    monkeypatch.setenv("RANK", "0")
    compat.warn_untested_versions()
    compat.warn_untested_versions()
    assert capsys.readouterr().out == f"[sparsebalance] {msg}\n"


def test_setup_py_declares_the_tested_range():
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    first, last = compat.TESTED_MEGATRON_CORE[0], compat.TESTED_MEGATRON_CORE[-1]
    major, minor = last.split(".")[:2]
    assert f'"megatron-core>={first},<{major}.{int(minor) + 1}"' in setup
