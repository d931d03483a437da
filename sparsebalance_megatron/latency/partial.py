"""A latency profile saved as it is measured, so that a profile cut short resumes where it stopped.

The profiler (``megatron/launch/profile.py``) writes every measured sample to ``<table>.partial.jsonl``
next to the table it is making: one JSON line per sample, after a header line holding the
profile's identity (what it measures: device, software versions, model shape, execution,
attention settings and the grid). A run killed while profiling finds the file on its retry:
with the same identity its samples are reused and only the rest is measured; with another
identity (another model, flags, device, version) it is ignored with a message and the profile
starts over. A last line torn by a kill is dropped. A damaged file is never resumed blindly:
one whose header cannot identify the profile (not UTF-8, not JSON, no identity) is moved aside
to ``<file>.damaged-<n>`` with one line naming it, and the profile starts over; under a sound
header each damaged record line (not UTF-8 or JSON, a sample that is not two times in seconds
> 0, an unknown record) is dropped, its sample measured again, and the file as found is moved
aside the same way. The finished table is written as before (``table.write_table``) and the
partial file removed.

Lines: ``{"identity": {...}}`` first, then ``{"key": "first/0/3", "value": [fwd_s, bwd_s]}``
(stage kind / repeat / grid point) and the profile's other steps (``"total"``: the samples
of the whole profile, ``"backend_choice"``, ``"crossover"``). A lock file (``.lock``) keeps two
profilers from writing one profile.

Pure Python (json, os): no numpy, no torch, no megatron.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
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


MAX_SAMPLE_S = 1e6    # latency/table.py's MAX_MICROBATCH_S: a longer "time" is not a measurement


@dataclass
class _Contents:
    """What a partial profile file holds: ``damaged`` (why its header cannot identify the
    profile) or the header identity with its well-formed records; ``bad``: (line number, why)
    of record lines dropped; ``torn``: the last line was cut short (a kill while appending)."""

    header: Optional[dict] = None
    records: list = field(default_factory=list)
    damaged: Optional[str] = None
    bad: list = field(default_factory=list)
    torn: bool = False


def _finite_time(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) \
        and 0 < x <= MAX_SAMPLE_S


def _record_problem(key: str, value) -> Optional[str]:
    """Why the record ``key: value`` is not one ``profile_table`` wrote, or None."""
    parts = key.split("/")
    if len(parts) == 3:
        if not (parts[0] and parts[1].isdigit() and parts[2].isdigit()):
            return f"sample key {key!r} is not KIND/REPEAT/POINT"
        if not (isinstance(value, list) and len(value) == 2):
            return f"sample {key} is {str(value)[:40]!r}: expected [forward s, backward s]"
        if not all(_finite_time(x) for x in value):
            return (f"sample {key} is {value!r}: expected two measured times in seconds in "
                    f"(0, {MAX_SAMPLE_S:g}]")
        return None
    if key == "total":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        return None if ok else f"total {value!r}: expected a count of samples >= 0"
    if key == "backend_choice":
        ok = isinstance(value, dict) and "choice" in value and \
            (value["choice"] is None or (isinstance(value["choice"], dict)
                                         and isinstance(value["choice"].get("chosen"), str)))
        return None if ok else f"backend_choice {str(value)[:40]!r}: expected {{'choice': ...}}"
    if key == "crossover":
        return None if isinstance(value, dict) else f"crossover {str(value)[:40]!r}: expected " \
            f"an object"
    return f"unknown record {key!r}"


def _read(path: str) -> _Contents:
    """The file at ``path`` line by line (bytes: one line that is not UTF-8 spoils itself only)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        return _Contents(damaged=f"it cannot be read: {e.strerror or e}")
    lines = data.split(b"\n")
    torn_candidate = not data.endswith(b"\n")      # the last piece was never finished
    try:
        header = json.loads(lines[0].decode("utf-8"))
    except UnicodeDecodeError:
        return _Contents(damaged="its first line is not UTF-8 text")
    except json.JSONDecodeError:
        return _Contents(damaged="its first line is not a JSON header" if lines[0].strip()
                         else "it has no header line")
    if not (isinstance(header, dict) and isinstance(header.get("identity"), dict)):
        return _Contents(damaged="its first line names no profile identity")
    out = _Contents(header=header["identity"])
    last = len(lines) - 1
    for i, raw in enumerate(lines[1:], 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if i == last and torn_candidate:
                out.torn = True           # a kill in the middle of ``put``: not a sample
            else:
                out.bad.append((i + 1, "not UTF-8 text" if isinstance(e, UnicodeDecodeError)
                                else "not JSON"))
            continue
        if not (isinstance(obj, dict) and isinstance(obj.get("key"), str) and "value" in obj):
            out.bad.append((i + 1, "not a {key, value} record"))
            continue
        why = _record_problem(obj["key"], obj["value"])
        if why is not None:
            out.bad.append((i + 1, why))
        else:
            out.records.append((obj["key"], obj["value"]))
    return out


def _aside(path: str) -> str:
    """``path`` renamed to the first free ``<path>.damaged-<n>``; that name."""
    n = 1
    while os.path.exists(f"{path}.damaged-{n}"):
        n += 1
    os.replace(path, f"{path}.damaged-{n}")
    return f"{path}.damaged-{n}"


def read_progress(path: str) -> Optional[tuple[int, Optional[int]]]:
    """(samples measured, samples in the whole profile or None) of the partial profile at
    ``path``, or None when there is none (for ranks waiting on another's profile)."""
    if not os.path.exists(path):
        return None
    got = _read(path)
    if got.header is None:
        return None
    done = {k for k, _ in got.records if k.count("/") == 2}
    total = next((v for k, v in got.records if k == "total"), None)
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
        got = _read(path) if os.path.exists(path) else _Contents()
        records, note = got.records, ""
        if fresh and os.path.exists(path):
            say(f"ignoring the partial latency profile {path} as asked (--no-resume); "
                f"profiling from the start")
            records = []
        elif got.damaged is not None:
            # Moved aside, not deleted (it is evidence) nor kept (every retry would fail alike).
            say(f"moved the damaged partial latency profile {path} aside to {_aside(path)} "
                f"({got.damaged}: it cannot say what its samples measured); profiling from the "
                f"start")
            records = []
        elif got.header is not None and got.header != self.identity:
            say(f"ignoring the partial latency profile {path}: it was measured for another "
                f"setup ({', '.join(_differences(got.header, self.identity))} differ); "
                f"profiling from the start")
            records = []
        elif got.bad:
            # The header identifies the samples: the sound ones are kept, each damaged line is
            # dropped (its sample measured again), and the file as found is kept for a look.
            n, why = got.bad[0]
            more = f" and {len(got.bad) - 1} more" if len(got.bad) > 1 else ""
            note = (f"; {len(got.bad)} damaged line(s) dropped (line {n}: {why}{more}), the "
                    f"file as found moved to {_aside(path)}")
        elif got.torn:
            note = "; its last line, cut short by the kill, dropped"
        self.records = dict(records)
        self.resumed = sum(1 for k in self.records if k.count("/") == 2)
        if self.resumed or note:
            say(f"resuming the latency profile from {path}: {self.resumed} samples were "
                f"measured before, only the rest are measured now{note}")
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
