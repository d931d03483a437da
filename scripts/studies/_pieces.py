"""The device plan's carries (``scripts/gpu_plan.py``): wheels and bundles packed here into
checksummed pieces (one xz-compressed tar cut to the rooms the plan's calls have), and on the
machine verified against their ``SHA256SUMS``, staged until their set is whole, joined, checked
whole and installed (``pip --no-index --no-deps --target``).

Pure Python (hashlib, lzma, tarfile, zipfile); runs there with nothing installed.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from typing import Dict, List, Sequence

MIB = 1 << 20
MANIFEST = "SHA256SUMS"
SITE = "/tmp/site"
STAGE = "/tmp/wheel_pieces"


# --- pieces ----------------------------------------------------------------------------------

def sha256_file(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def write_manifest(folder: str, extra: Dict[str, str] = ()) -> str:
    """``folder/SHA256SUMS``: ``sha256  name`` per file (sha256sum's format), plus ``extra``."""
    lines = {n: sha256_file(os.path.join(folder, n)) for n in sorted(os.listdir(folder))
             if n != MANIFEST and os.path.isfile(os.path.join(folder, n))}
    lines.update(dict(extra))
    path = os.path.join(folder, MANIFEST)
    with open(path, "w") as fh:
        fh.writelines(f"{h}  {n}\n" for n, h in lines.items())
    return path


def read_manifest(folder: str) -> Dict[str, str]:
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise ValueError(f"{folder}: no {MANIFEST}: expected the folder gpu_wheels.sh made")
    out = {}
    for line in open(path):
        if line.strip():
            h, name = line.split(None, 1)
            out[name.strip()] = h
    return out


def verify(folder: str, names=None) -> None:
    """Every file of ``folder``'s manifest (or ``names`` of it) has its sha256, else ValueError."""
    want = read_manifest(folder)
    stray = [n for n in os.listdir(folder) if (n.endswith(".whl") or n.startswith("piece."))
             and n not in want]
    if stray:
        raise ValueError(f"{folder}: {', '.join(sorted(stray))} not in {MANIFEST}")
    for name in (names if names is not None else
                 [n for n in want if os.path.exists(os.path.join(folder, n))]):
        path = os.path.join(folder, name)
        if name not in want or not os.path.exists(path):
            raise ValueError(f"{path}: missing or not in {MANIFEST}")
        got = sha256_file(path)
        if got != want[name]:
            raise ValueError(f"{path}: sha256 {got[:16]}..., expected {want[name][:16]}... "
                             f"(a broken or mixed carry)")


def _stored(path: str) -> bytes:
    """A wheel (a zip) rewritten with its members stored, not deflated, so that xz sees the
    files themselves: the same wheel to pip (RECORD hashes the members, not the archive)."""
    out = io.BytesIO()
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    return out.getvalue()


def pack(src: str, dest: str, piece_bytes, preset: int = 9) -> List[str]:
    """The files under ``src`` as one xz-compressed tar (wheels stored uncompressed inside,
    which xz then packs about a third smaller than their own deflate: FA4's set 97.5 -> ~70
    MiB) cut into pieces: the fewest equal ones of at most ``piece_bytes``, or, given a list of
    sizes (the room each call of a plan has), one piece per size, each in proportion to it, so
    that every call of the plan carries its piece. ``dest/1/piece.00``, ``dest/2/piece.01``..., each folder with a manifest of its
    piece and of the whole archive (``all.tar.xz``), checked on the machine before anything is
    unpacked. ``preset``: xz's (9, the smallest; a test's quick packing may take less)."""
    if not os.path.isdir(src) or not os.listdir(src):
        raise ValueError(f"{src}: expected a folder of files to pack")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d, dirs, files in sorted(os.walk(src)):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(d, name)
                data = _stored(path) if name.endswith(".whl") else open(path, "rb").read()
                info = tarfile.TarInfo(os.path.relpath(path, src))
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
    data = lzma.compress(buf.getvalue(), preset=preset)
    whole = hashlib.sha256(data).hexdigest()
    if isinstance(piece_bytes, int):
        n = max(1, -(-len(data) // piece_bytes))
        sizes = [-(-len(data) // n)] * n
    else:
        room = sum(piece_bytes)
        if len(data) > room:
            raise ValueError(f"{src}: {len(data) / MIB:.1f} MiB compressed, more than the "
                             f"{room / MIB:.1f} MiB the pieces can hold")
        ends = [len(data) * sum(piece_bytes[:i + 1]) // room for i in range(len(piece_bytes))]
        sizes = [b - a for a, b in zip([0] + ends, ends)]
    n, at, folders = len(sizes), 0, []
    for i, size in enumerate(sizes):
        folder = os.path.join(dest, str(i + 1))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"piece.{i:02d}"), "wb") as fh:
            fh.write(data[at:at + size])
        at += size
        write_manifest(folder, {"all.tar.xz": whole, f"pieces.{n}": "0" * 64})
        folders.append(folder)
    return folders


def join_pieces(stage: str, out_dir: str) -> bool:
    """Unpack the archive whose pieces sit in ``stage`` (their manifests copied alongside) into
    ``out_dir`` when all have come; False while some are missing. Checks the whole archive's
    sha256 before decompressing or extracting anything."""
    man = read_manifest(stage)
    n = int(next(k for k in man if k.startswith("pieces.")).split(".")[1])
    names = [f"piece.{i:02d}" for i in range(n)]
    if not all(os.path.exists(os.path.join(stage, p)) for p in names):
        return False
    h, data = hashlib.sha256(), bytearray()
    for p in names:
        chunk = open(os.path.join(stage, p), "rb").read()
        h.update(chunk)
        data += chunk
    if h.hexdigest() != man["all.tar.xz"]:
        raise ValueError(f"{stage}: the joined pieces' sha256 differs from the manifest's "
                         f"all.tar.xz")
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(bytes(data)))) as tar:
        tar.extractall(out_dir, filter="data")
    return True


def unpack(folders: Sequence[str], site: str = SITE, stage: str = STAGE,
           complete=False) -> str:
    """There: verify each folder, then install its wheels into ``site`` (``--no-deps``). A piece
    is staged in ``stage/<its set>`` (the folder above it: ``.whl-fa4``, ``.sb-quality``) until
    its set is complete; a complete set is unpacked into ``stage/<set>/files``, and the wheels
    among its files are installed. Returns what was done, in words. ``complete`` (True: every
    folder; or the folders it names): a set of those whose other pieces are not staged is a
    ValueError (the machine came back bare)."""
    wheels, waiting, unpacked = [], [], []
    for folder in folders:
        verify(folder)
        names = os.listdir(folder)
        if any(n.startswith("piece.") for n in names):
            where = os.path.join(stage, os.path.basename(os.path.dirname(os.path.abspath(folder))))
            os.makedirs(where, exist_ok=True)
            for n in names:
                if n.startswith("piece."):
                    shutil.copyfile(os.path.join(folder, n), os.path.join(where, n))
            with open(os.path.join(folder, MANIFEST)) as src, \
                    open(os.path.join(where, MANIFEST), "w") as dst:
                dst.write(src.read())
            joined = os.path.join(where, "files")
            if not join_pieces(where, joined):
                if complete is True or folder in (complete or ()):
                    raise ValueError(f"{folder}: the other pieces are not in {where} (a bare "
                                     f"machine: the calls that carry them must run first)")
                waiting.append(f"{folder}: staged; waiting for the other pieces in {where}")
                continue
            unpacked.append(f"{folder}: its set unpacked into {joined}")
            wheels += [os.path.join(joined, n) for n in os.listdir(joined) if n.endswith(".whl")]
        else:
            wheels += [os.path.join(folder, n) for n in names if n.endswith(".whl")]
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", "--upgrade", "--target", site,
                        *sorted(wheels)], check=True)
    return "; ".join([f"installed {len(wheels)} wheels into {site}"] + unpacked + waiting)
