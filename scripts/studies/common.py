"""What every study and device script shares: its argument parser, the median time of a call, the
result writer (command, commit, versions and device beside the figures), the simulated studies'
model shapes, and one run of the README's CPU job (``cp_step``, ``dense_sab_run``).

Nothing here imports torch or megatron (``median_ms`` and ``gpu_provenance`` use the torch their
caller has imported).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Set by scripts/bench.py to the command line that ran the study (`python scripts/bench.py NAME ...`).
COMMAND: list[str] | None = None
# the simulated studies' model shapes (ModelShape fields; sim_study, hybrid_cp)
MODELS = {
    "qwen2.5-0.5b": {},          # ModelShape's defaults
    "llama3.2-1b": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192,
                        num_attention_heads=32, num_query_groups=8, kv_channels=64,
                        vocab_size=128256),
}
DISTRIBUTIONS = ("torch", "numpy", "numba", "megatron-core", "sparsebalance_megatron", "triton")


def command() -> str:
    """The command that ran this study or script, as a user would type it again from the
    repository root (a script of the repository by its path from there)."""
    if COMMAND is not None:
        return " ".join(COMMAND)
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if script.startswith(ROOT + os.sep):
        return " ".join(["python", os.path.relpath(script, ROOT), *sys.argv[1:]])
    return " ".join(["python", *sys.argv])


def torchrun(nproc: int) -> list[str]:
    """The command that starts ``nproc`` ranks of a script on this machine, before the script:
    torchrun (``--standalone``), or the torchrun-compatible launcher script that
    ``SB_TORCHRUN`` names, run with this Python (the test suite's ``tests/forked_ranks.py``)."""
    launcher = os.environ.get("SB_TORCHRUN")
    head = [sys.executable, launcher] if launcher else [sys.executable, "-m",
                                                         "torch.distributed.run"]
    return [*head, "--standalone", f"--nproc_per_node={nproc}"]


def parser(doc: str | None, name: str, json_arg: bool = True,
           json_required: bool = False) -> argparse.ArgumentParser:
    """A study's parser: its docstring's first paragraph as the description, and ``--json PATH``
    (where ``write_result`` puts the figures) unless the study writes a result of another kind."""
    p = argparse.ArgumentParser(prog=f"python scripts/bench.py {name}",
                                description=(doc or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if json_arg:
        p.add_argument("--json", metavar="PATH", required=json_required,
                       help="write the results here (JSON with the command, commit, versions "
                            "and device)")
    return p


def median_ms(fn, reps: int, warmup: int = 2, cuda: bool | None = None, clock=None) -> float:
    """Median milliseconds of ``fn`` over ``reps`` calls after ``warmup`` calls: by CUDA events
    where ``cuda`` (default: torch sees a GPU), synchronised after each call, else by ``clock``
    (default the wall clock: a CPU check of a GPU script under ``TRITON_INTERPRET=1``;
    ``time.thread_time``: the calling thread's CPU, what a loaded machine's waits leave out)."""
    if reps < 1:
        raise ValueError(f"reps={reps}: expected at least one timed call")
    torch = sys.modules.get("torch")
    if cuda is None:
        cuda = torch is not None and torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    times = []
    if not cuda:
        clock = clock or time.perf_counter
        for _ in range(reps):
            t0 = clock()
            fn()
            times.append((clock() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


SLEEP_MS = 20.0      # the GPU's head start in host_and_gpu_ms: longer than any call's host work


def host_and_gpu_ms(fn, reps: int, sleep_ms: float = SLEEP_MS) -> dict:
    """Where a call's time goes on a GPU (``{}`` without one): ``host_ms``, the median wall time
    of ``fn()`` with nothing awaited, and ``gpu_ms``, the median time of its work on the GPU alone
    (its events queued behind a ``sleep_ms`` sleep kernel). ``held`` counts the calls whose host
    time reached the sleep (a device-to-host read inside ``fn``: their ``gpu_ms`` counts it)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return {}
    if reps < 1:
        raise ValueError(f"reps={reps}: expected at least one timed call")
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 1_000_000
    fn()
    torch.cuda.synchronize()
    a.record()
    torch.cuda._sleep(probe)
    b.record()
    torch.cuda.synchronize()
    cycles = int(probe * sleep_ms / max(a.elapsed_time(b), 1e-3))
    host, gpu, held = [], [], 0
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b))
        held += host[-1] >= 0.9 * sleep_ms
    return {"host_ms": statistics.median(host), "gpu_ms": statistics.median(gpu), "held": held,
            "reps": reps}


def _git(*args) -> str | None:
    try:
        p = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def device() -> str:
    """The CUDA device when torch is loaded and sees one, else the CPU model and core count."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh
                          if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu: {model} x{os.cpu_count()}"


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def provenance() -> dict:
    """Command, commit (and whether the tree had changes), versions (numba's: the planner's
    kernels) and device."""
    # the result files themselves (a study rewriting the one it re-runs) are not code changes
    status = _git("status", "--porcelain", "--", ".", ":(exclude)docs/results")
    commit = _git("rev-parse", "HEAD")
    given = os.environ.get("SPARSEBALANCE_COMMIT")
    if given:       # a device call: its copy's git metadata is not the tree it ran (gpu_plan)
        commit, status = given, None
    return {"command": command(), "commit": commit,
            "dirty": None if status is None else bool(status), "versions": versions(),
            "device": device()}


def gpu_provenance() -> dict:
    """``provenance()`` with, at the top level, what a device figure depends on: the torch,
    CUDA and triton versions (None where absent) and the CUDA device's name (None without one)."""
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {**provenance(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton_version,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def write_result(path: str | None, doc: dict) -> dict:
    """Write ``doc`` as JSON to ``path`` (nothing when ``path`` is None) with the provenance
    keys added; a study's own ``device`` (a richer name) is kept. Returns what was written."""
    prov = provenance()
    if "device" in doc:
        prov.pop("device")
    out = {**doc, **prov}
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {path}")
    return out


# ---- the README's CPU job ---------------------------------------------------------------------

UNTIMED_STEPS = 2     # the README job's warm-up steps (run_demo): not timed


# ---- the quality studies' pilot: it fixes the margins a main run's verdicts use ---------------

def add_pilot_args(ap) -> None:
    ap.add_argument("--pilot", action="store_true",
                    help="fix the margins and the n for the main run")
    ap.add_argument("--margin-from", default=None, metavar="PILOT.json",
                    help="the pilot's JSON: its margins (the main run)")
    ap.add_argument("--margin-fraction", type=float, default=0.5,
                    help="the pilot's margin: this share of the control's mean harm")


def check_pilot(ap, args) -> None:
    if args.pilot == (args.margin_from is not None):
        ap.error("give --pilot (fix the margins) or --margin-from PILOT.json (the main run)")


def pilot_margin(args, harm: float, sd, compare_sd) -> tuple:
    """A pilot's (margin, n needed) of one metric: ``--margin-fraction`` of the control's mean
    ``harm`` (None where the control did no harm), and the n at 80% power that detects the
    control (its SD ``sd``) and finds the arm non-inferior at that margin (``compare_sd``: that
    comparison's SD; none measured: 2); None where the harm or ``sd`` is 0."""
    from sparsebalance_megatron.eval import verdict as V

    margin = args.margin_fraction * harm if harm > 0 else None
    if not (harm > 0 and sd):
        return margin, None
    return margin, {"control": V.n_needed(sd, harm),
                    "non_inferior": V.n_needed(compare_sd, margin) if compare_sd else 2}


def read_margin(args, same, before: dict | None = None, **source) -> dict:
    """The margins of the pilot at ``--margin-from``, refused unless it is a pilot's JSON with a
    margin that ran with the main run's ``same`` settings (a margin holds for the setting it
    was fixed in); ``before``: the value of a setting added since, for a pilot that predates it;
    ``source``: {key: f(pilot)} recorded in ``margin_source`` beside its path and commit."""
    path = args.margin_from
    with open(path) as f:
        pilot = json.load(f)
    if not (pilot.get("config") or {}).get("pilot") or not pilot.get("margin"):
        raise SystemExit(f"error: --margin-from {path}: not a pilot's JSON with a margin (run "
                         f"--pilot first)")
    before = before or {}
    differ = [k for k in same if pilot["config"].get(k, before.get(k)) != getattr(args, k)]
    if differ:
        raise SystemExit(f"error: --margin-from {path}: the pilot ran with other "
                         f"{', '.join(differ)}: a margin holds for the setting it was fixed in")
    return {"margin": pilot["margin"], "margin_source": {
        "path": path, "commit": pilot.get("commit"),
        "fraction": pilot["config"]["margin_fraction"], **{k: f(pilot) for k, f in source.items()}}}


def spearman(a, b) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (ties ranked in their order)."""
    import numpy as np

    ra, rb = (np.argsort(np.argsort(x)).astype(float) for x in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / np.sqrt((ra ** 2).sum() * (rb ** 2).sum()))


def matched_uniform(kept_of, target: float, lo: float, steps: int) -> float:
    """The uniform density in [``lo``, 1] whose kept density ``kept_of(d)`` (rising with d) is
    nearest ``target``: ``steps`` halvings, then the nearer end."""
    a, b = lo, 1.0
    for _ in range(steps):
        mid = 0.5 * (a + b)
        a, b = (mid, b) if kept_of(mid) < target else (a, mid)
    return min((a, b), key=lambda d: abs(kept_of(d) - target))


def add_steps_arg(ap, default: int) -> None:
    ap.add_argument("--steps", type=int, default=default,
                    help=f"training steps per run (>= 4; the first {UNTIMED_STEPS} are not timed)")


def check_steps(ap, steps: int) -> None:
    if steps < UNTIMED_STEPS + 2:
        ap.error(f"--steps {steps}: expected >= {UNTIMED_STEPS + 2} (the first "
                 f"{UNTIMED_STEPS} steps are not timed)")


def run_demo(extra: list, out: str, label: str, steps: int, prefix=(), **env) -> tuple:
    """Run the README job with ``extra`` flags into ``out`` (``env``: NPROC, PP, ...).
    Returns (per-step metrics rows, the timed steps' seconds, the finished process); a failed
    run stops the benchmark with its output."""
    env = dict(os.environ, OUT=out, TRAIN_ITERS=str(steps), OMP_NUM_THREADS="1",
               PY=sys.executable, **{k: str(v) for k, v in env.items()})
    p = subprocess.run([*prefix, "bash", "examples/run_cpu_demo.sh", *extra], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{label} run failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n"
                         f"{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if x.strip()]
    return rows, [r["step_time_s"] for r in rows[UNTIMED_STEPS:]], p

