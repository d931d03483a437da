"""Shared fixtures: small real-text data files and a torchrun launcher for the training entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "examples" / "pretrain_gpt_sparsebalance.py"
HYBRID_ENTRY = REPO / "examples" / "pretrain_hybrid_sparsebalance.py"
SLOW_ENV = "SB_SLOW_TESTS"

# Under pytest-xdist the workers are the suite's parallelism (make test: two on two cores), and
# torch's default of one thread a core had them oversubscribe the machine: each worker, and each
# process it starts, computes on one thread (as every rank the tests launch already did).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (resumes, checkout comparisons: minutes each) run only with
    SB_SLOW_TESTS=1, which keeps ``make test`` within its time budget."""
    if os.environ.get(SLOW_ENV):
        return
    skip = pytest.mark.skip(reason=f"slow: set {SLOW_ENV}=1 to run")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)

# --- megatron-core 0.20, opt-in --------------------------------------------------------------------
# SB_MEGATRON_CORE_020=DIR: the tests, and every process they start (torchrun, the profiler), import
# the megatron installed in DIR (`pip install --no-deps --target DIR /path/to/Megatron-LM` of main,
# megatron-core 0.20.0; `make mcore020 MEGATRON_LM=...` does it), ahead of the venv's 0.19.2.
MEGATRON_CORE_020 = os.environ.get("SB_MEGATRON_CORE_020")
if MEGATRON_CORE_020:
    MEGATRON_CORE_020 = str(Path(MEGATRON_CORE_020).resolve())
    sys.path.insert(0, MEGATRON_CORE_020)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (MEGATRON_CORE_020, str(REPO), os.environ.get("PYTHONPATH")) if p)


def pytest_configure(config):
    from tests import reliability    # the reliability cases (RELIABILITY.md, make reliability)

    config.pluginmanager.register(reliability, "sb-reliability")
    if not MEGATRON_CORE_020:
        return
    import megatron.core

    where, version = megatron.core.__file__, megatron.core.__version__
    if not (where.startswith(MEGATRON_CORE_020) and version.startswith("0.20.")):
        raise pytest.UsageError(f"SB_MEGATRON_CORE_020={MEGATRON_CORE_020}: imported megatron-core "
                                f"{version} from {where}; expected 0.20.x from that directory "
                                f"(pip install --no-deps --target DIR /path/to/Megatron-LM)")


def pytest_report_header(config):
    if MEGATRON_CORE_020:
        import megatron.core
        return f"megatron-core {megatron.core.__version__} from {MEGATRON_CORE_020} " \
               f"(SB_MEGATRON_CORE_020)"


def load_script(name: str):
    """``scripts/<name>.py`` as a module (registered in ``sys.modules``: dataclasses look their
    module up there)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / f"scripts/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_study(name: str):
    """A fresh copy of ``scripts/studies/<name>.py`` (``studies.<name>`` in ``sys.modules``, its
    package's other modules imported as they are): a test may change its attributes."""
    import importlib.util

    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    import studies  # noqa: F401  (the package the study's relative imports resolve in)

    spec = importlib.util.spec_from_file_location(f"studies.{name}",
                                                  REPO / f"scripts/studies/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def stdlib_texts(n: int, max_chars: int = 6000) -> list[str]:
    """Real text with varied lengths: the first ``n`` CPython stdlib modules, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.glob("*.py")):
        text = p.read_text(encoding="utf-8", errors="replace")[:max_chars]
        if len(text) > 200:
            out.append(text)
        if len(out) == n:
            break
    return out


LENIENT_DEADLINE_S = 30.0


@pytest.fixture
def lenient_draft_deadline(monkeypatch):
    """For a test whose subject is the planner process's plans or deaths, not its deadline:
    the deadline's floor at ``LENIENT_DEADLINE_S``, so that a loaded machine's slow draft (or one
    waiting on a peer's rounds) does not read as late. The fault tests time the deadline itself;
    a spawned rank sets the same floor in its own process."""
    from sparsebalance_megatron.megatron.step import ahead

    monkeypatch.setattr(ahead, "STALL_FLOOR_S", LENIENT_DEADLINE_S)


@pytest.fixture(scope="session")
def short_docs_jsonl(tmp_path_factory) -> Path:
    """Short real documents (40-300 characters of stdlib modules): with the byte tokenizer and
    256-token micro-batches the fill is a real share of a step (variable-length tests)."""
    import numpy as np

    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("data") / "short.jsonl"
    with open(path, "w") as f:
        for t in stdlib_texts(160, max_chars=3000):
            f.write(json.dumps({"text": t[:int(rng.integers(40, 300))]}) + "\n")
    return path


@pytest.fixture(scope="session")
def small_jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    with open(path, "w") as f:
        for t in stdlib_texts(120, max_chars=3000):
            f.write(json.dumps({"text": t}) + "\n")
    return path


TINY_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--seq-length", "256", "--max-position-embeddings", "256",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--micro-batch-size", "1", "--lr", "1e-3", "--lr-decay-style", "constant",
    "--clip-grad", "1.0", "--log-interval", "1", "--seed", "7",
]

# Planning on a daemon thread of the rank (``--sb-planner thread``) for a run whose subject is not
# the planner process (its start, death, stall, stop, relayed rounds, refresh, restart, exit): the
# same plans as the default process (tests/unit/test_plan_ahead.py draws all three planners'),
# without a fresh interpreter per rank (about 1 s of CPU each). The runs kept on the process are
# listed in tests/README.md.
PLANNER_THREAD = ["--sb-planner", "thread"]


LAUNCHER = os.environ.get("SB_TEST_LAUNCHER", "fork")
if LAUNCHER not in ("fork", "torchrun"):
    raise ValueError(f"SB_TEST_LAUNCHER={LAUNCHER!r}: expected 'fork' or 'torchrun'")
_SERVER = None
_START_ENV = dict(os.environ)   # the server's: not the variables of the test that starts it


def _forked_ranks():
    """This pytest process's server of forked ranks (tests/forked_ranks.py), started on first use."""
    global _SERVER
    from tests.forked_ranks import Server

    if _SERVER is None:
        _SERVER = Server(env=_START_ENV)
    return _SERVER


@pytest.fixture(scope="session")
def tiny_latency_table(tmp_path_factory) -> Path:
    """A quick latency table for TINY_MODEL (the profiler CLI, as a user would run it)."""
    return _profile_tiny(tmp_path_factory.mktemp("lat") / "lat.json", pp=1)


@pytest.fixture(scope="session")
def tiny_latency_table_pp2(tmp_path_factory) -> Path:
    """The same for a 2-stage pipeline (first, last and a middle stage: any layout)."""
    return _profile_tiny(tmp_path_factory.mktemp("lat") / "lat_pp2.json", pp=2)


def _analytic_table(tmp_path_factory, pp: int) -> Path:
    from sparsebalance_megatron.latency.analytic import analytic_table, ideal_price
    from sparsebalance_megatron.latency.shape import ModelShape
    from sparsebalance_megatron.latency.table import write_table

    shape = ModelShape(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, vocab_size=8192, seq_length=256, pp=pp)
    out = tmp_path_factory.mktemp("lat") / f"analytic_pp{pp}.json"
    # the ideal FLOP-priced kernel these runs' assertions were made with (the price is not
    # their subject: latency/sparse_call.py's tests are)
    write_table(analytic_table(shape, pp=pp, block_size=32, transformer_impl="local",
                               sparse_price=ideal_price()), str(out))
    return out


@pytest.fixture(scope="session")
def analytic_latency_table_pp2(tmp_path_factory) -> Path:
    """A deterministic pp=2 table of TINY_MODEL's shape (the analytic model, not a measurement):
    for tests whose assertions depend on what DST decides, which a table profiled on a loaded
    machine would make vary from run to run."""
    return _analytic_table(tmp_path_factory, 2)


@pytest.fixture(scope="session")
def analytic_latency_table_pp1(tmp_path_factory) -> Path:
    """The same on one pipeline stage."""
    return _analytic_table(tmp_path_factory, 1)


def _profile_tiny(out: Path, pp: int) -> Path:
    module = "sparsebalance_megatron.megatron.profile_cli"
    args = ["--quick", "--no-progress", "--out", str(out), "--num-layers", "4", "--hidden-size",
            "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups",
            "2", "--vocab-size", "384", "--seq-length", "256", "--sb-block-size", "32",
            "--pipeline-model-parallel-size", str(pp),
            "--mixes", "3", "--densities", "0.25", "1.0", "--repeats", "1"]
    proc = run_python(["-m", module, *args], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise AssertionError(f"-m {module} failed:\n{proc.stdout[-4000:]}")
    return out


def run_python(argv: list, *, cwd: Path, env: dict = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``python ARGV`` (a script, ``-m module`` or ``-c code``, then its arguments) in ``cwd``,
    with ``env`` as its whole environment (default this process's); returns what
    ``subprocess.run`` returns, stdout and stderr merged. Under the fork launcher (the default)
    the process is forked from the server, which has imported megatron-core, transformers and
    the plugin (6-8 s of CPU a fresh interpreter spends first); with SB_TEST_LAUNCHER=torchrun
    it is a fresh interpreter."""
    argv = [str(a) for a in argv]
    env = dict(os.environ) if env is None else env
    if LAUNCHER == "fork":
        entry, args = (" ".join(argv[:2]), argv[2:]) if argv[0] in ("-m", "-c") else \
            (argv[0], argv[1:])
        return _forked_ranks().run(entry, args, 0, cwd, env, timeout)
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def run_entry(nproc: int, args: list, *, cwd: Path, timeout: int = 300, check: bool = True,
              entry: Path = ENTRY, env: dict = None, launcher: str = None):
    """Run the training entry (the GPT one unless ``entry``: also a patched Megatron-LM
    ``pretrain_*.py``) on ``nproc`` ranks; returns the CompletedProcess (stdout+stderr merged).
    ``env``: variables set on top of this process's (e.g. a ``PATH`` with stand-in tools).
    ``launcher``: ``"fork"`` (ranks forked from a process that imported megatron-core once:
    tests/forked_ranks.py) or ``"torchrun"``, for what only torchrun does (its failure summary,
    its error file); SB_TEST_LAUNCHER sets the default."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    if (launcher or LAUNCHER) == "fork":
        proc = _forked_ranks().run(entry, list(args), nproc, cwd, env, timeout)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(entry), *map(str, args)]
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{proc.args[0]} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-6000:]}")
    return proc


def spawn(fn, nprocs: int, *args, cwd: Path, timeout: int = 600) -> None:
    """``fn(rank, *args)`` on ``nprocs`` ranks (a test's own gloo group), as
    ``torch.multiprocessing.spawn`` runs it, through ``run_entry`` (``tests/spawned_rank.py``):
    forked from the server, a rank skips a fresh interpreter's imports of torch, megatron-core
    and the plugin (1.5-10 s of CPU a process). ``args``: JSON values; a rank that raises
    fails the call with its traceback."""
    import inspect

    run_entry(nprocs, [inspect.getfile(fn), fn.__module__, fn.__name__, json.dumps(list(args))],
              cwd=cwd, timeout=timeout, entry=REPO / "tests" / "spawned_rank.py")


def script_launch_env() -> dict:
    """Variables for a script that starts its own runs (``scripts/studies/common.py``
    ``torchrun``): under the fork launcher, its ranks are forked by this process's server."""
    if LAUNCHER != "fork":
        return {}
    server = _forked_ranks()
    server.start()
    return {"SB_TORCHRUN": str(REPO / "tests" / "forked_ranks.py"), "SB_FORKED_RANKS": server.path}


def pytest_unconfigure(config):
    if _SERVER is not None:
        _SERVER.close()


def close(a: float, b: float, rtol: float) -> bool:
    """``a`` and ``b`` agree within ``rtol`` of the larger (runs compared step by step)."""
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


@pytest.fixture(scope="module")
def megatron_single_process():
    """Megatron's model-parallel state on a 1-process gloo group, with the CPU shims, for the
    tests of a module that build megatron-core models in-process."""
    from sparsebalance_megatron.megatron.launch.compat import activate_cpu_shims
    from sparsebalance_megatron.megatron.launch.profile import init_single_process

    activate_cpu_shims()
    init_single_process()
    yield


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_scalars(tb_dir: Path) -> dict:
    """{tag: {iteration: value}} from the TensorBoard event files Megatron's writer left."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
