"""A latency profile saved as it is measured, so that a profile cut short resumes where it stopped.

The profiler (``megatron/profile.py``) writes every measured sample to ``<table>.partial.jsonl``
next to the table it is making: one JSON line per sample, after a header line holding the
profile's identity (what it measures: device, software versions, model shape, execution,
attention settings and the grid). A run killed while profiling finds the file on its retry:
with the same identity its samples are reused and only the rest is measured; with another
identity (another model, flags, device, version) it is ignored with a message and the profile
starts over. A line torn by a kill is dropped. The finished table is written as before
(``table.write_table``) and the partial file removed.

Lines: ``{"identity": {...}}`` first, then ``{"key": "first/0/3", "value": [fwd_s, bwd_s]}``
(stage kind / repeat / grid point) and the profile's other steps (``"total"``: the samples
of the whole profile, ``"backend_choice"``, ``"crossover"``). A lock file (``.lock``) keeps two
profilers from writing one profile.

Pure Python (json, os): no torch, no megatron.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

SUFFIX = ".partial.jsonl"


class PartialProfileBusy(RuntimeError):
    """Another profiler holds the partial profile's lock."""


def partial_path(table_path: str) -> str:
    """Where the profile of ``table_path`` keeps its measured samples."""
    return table_path + SUFFIX


def _normal(obj):
    """``obj`` as it reads back from JSON (tuples become lists, keys strings)."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def _read_lines(path: str) -> tuple[Optional[dict], list[tuple[str, object]]]:
    """(header identity or None, [(key, value)] of every whole record line)."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().split("\n")
    except (OSError, UnicodeDecodeError):
        return None, []
    header, records = None, []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue      # a line torn by a kill (the last) or garbage: not a sample
        if i == 0:
            header = obj.get("identity") if isinstance(obj, dict) else None
            if header is None:
                return None, []
        elif isinstance(obj, dict) and isinstance(obj.get("key"), str) and "value" in obj:
            records.append((obj["key"], obj["value"]))
    return header, records


def read_progress(path: str) -> Optional[tuple[int, Optional[int]]]:
    """(samples measured, samples in the whole profile or None) of the partial profile at
    ``path``, or None when there is none (for ranks waiting on another's profile)."""
    if not os.path.exists(path):
        return None
    header, records = _read_lines(path)
    if header is None:
        return None
    done = {k for k, _ in records if k.count("/") == 2}
    total = next((v for k, v in records if k == "total"), None)
    return len(done), total if isinstance(total, int) else None


def _differences(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]


class PartialProfile:
    """The measured samples of one profile, appended to ``path`` as they are measured.

    ``identity``: a JSON-able dict of everything the samples depend on. An existing file with
    the same identity is resumed (``resumed`` samples), any other is replaced; ``say`` gets one
    line saying which (nothing for a new profile). ``fresh``: replace it whatever it holds
    (``sparsebalance-profile --no-resume``); the new samples are still saved as measured."""

    def __init__(self, path: str, identity: dict, *, say: Callable[[str], None] = print,
                 fresh: bool = False):
        self.path = path
        self.identity = _normal(identity)
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        self._lock = self._take_lock(path + ".lock")
        header, records = _read_lines(path) if os.path.exists(path) else (None, [])
        if fresh and os.path.exists(path):
            say(f"ignoring the partial latency profile {path} as asked (--no-resume); "
                f"profiling from the start")
            header, records = self.identity, []
        elif header is not None and header != self.identity:
            say(f"ignoring the partial latency profile {path}: it was measured for another "
                f"setup ({', '.join(_differences(header, self.identity))} differ); profiling "
                f"from the start")
            records = []
        elif header is None and os.path.exists(path):
            say(f"ignoring the partial latency profile {path}: unreadable header; profiling "
                f"from the start")
        self.records = dict(records)
        self.resumed = sum(1 for k in self.records if k.count("/") == 2)
        if self.resumed:
            say(f"resuming the latency profile from {path}: {self.resumed} samples were "
                f"measured before, only the rest are measured now")
        # Rewrite it whole (header + the whole records), atomically: a torn last line must not
        # swallow the first line appended after it.
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(json.dumps({"identity": self.identity}, sort_keys=True) + "\n")
            for k, v in self.records.items():
                fh.write(json.dumps({"key": k, "value": v}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        self._fh = open(path, "a", encoding="utf-8")

    @staticmethod
    def _take_lock(lock_path: str):
        try:
            import fcntl
        except ImportError:        # not POSIX: no lock (one profiler per cache by convention)
            return None
        fh = open(lock_path, "w")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            raise PartialProfileBusy(f"another profiler is writing {lock_path[:-5]} (it holds "
                                     f"{lock_path}); wait for it or stop it") from None
        return fh

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def get(self, key: str, default=None):
        return self.records.get(key, default)

    def put(self, key: str, value) -> None:
        """Record ``key`` and make it durable before returning (a kill right after keeps it)."""
        value = _normal(value)
        self._fh.write(json.dumps({"key": key, "value": value}) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.records[key] = value

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def discard(self) -> None:
        """The profile is finished (its table written): remove the partial file."""
        self.close()
        for p in (self.path, self.path + ".lock"):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass
