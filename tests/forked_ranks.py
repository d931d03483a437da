"""The suite's launcher for multi-rank runs: ranks forked from a process that has imported
megatron-core once, instead of torchrun's fresh interpreter per rank.

Importing megatron-core costs about 8-10 s of CPU per process (it imports dynamo and inductor),
which was half of the suite's CPU when every rank of every launch paid it. Here one server
process per pytest worker imports it once (``PRELOAD``), with what a rank imports next
(megatron's text tokenizers, which import transformers, and the plugin's step and planner with
numba's kernels loaded: about 2.3 s of a forked rank's 3 s of CPU in a short run before they
were preloaded); each launch forks a job leader, which forks the ranks.
A rank sets the variables torchrun would (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``, ...), then runs the entry
script as ``__main__`` with ``runpy``: everything from the argument parser on is the code a
torchrun rank runs. As torchrun does, the leader hosts the job's store (the ranks connect to it
before any process group: a refusal is claimed there, and the process group and the watchdog use
it), stops the other ranks when one fails and exits 1.

What only torchrun gives (its failure summary, ``TORCHELASTIC_ERROR_FILE``, its signal
forwarding) is tested with torchrun itself: ``run_entry(..., launcher="torchrun")``, and
``SB_TEST_LAUNCHER=torchrun`` runs every launch that way.

Two clients: tests/conftest.py (``run_entry``; ``spawn``, a test's own gloo group of
processes, through it; ``run_python``, one plain process: a script, ``-m module`` or ``-c
code``, without torchrun's variables, which ends as the process ends), and this file's command
line, which takes torchrun's arguments (``python tests/forked_ranks.py --standalone
--nproc_per_node=2 ENTRY ...``) for scripts that start their own runs: a test gives such a
script ``SB_FORKED_RANKS`` (the server's socket) and ``SB_TORCHRUN`` naming this file
(``conftest.script_launch_env``), and the study launches through it
(``scripts/studies/common.py`` ``torchrun``).

Protocol, on the server's Unix socket, one launch per connection and one at a time (a pytest
worker runs one test at a time): the client sends one JSON line ``{"entry"`` (or ``"module"``,
``"code"``) ``, "args", "nproc", "cwd", "env"}`` with its stdout and stderr as file
descriptors (SCM_RIGHTS); the server answers
``{"pid": leader}`` and, when the job has ended, ``{"rc": code}``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOCKET_ENV = "SB_FORKED_RANKS"
# what every entry imports first: megatron-core's training stack and the plugin's hooks
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.training",
           "megatron.training.arguments", "megatron.training.argument_utils",
           "sparsebalance_megatron.megatron.hooks",
           # what a run imports next: megatron's text tokenizers (transformers), the plugin's
           # step (its callback, the planner's drafting and numba)
           "megatron.core.tokenizers.text", "sparsebalance_megatron.megatron.step.callback",
           "sparsebalance_megatron.megatron.step.drafting")
STOP_GRACE_S = 5.0   # a failed job's other ranks: SIGTERM, then SIGKILL after this long
PARENT_POLL_S = 5.0  # how often an idle server checks that the process that started it lives


# --- server side ---------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(req: dict, rank: int | None, port: int) -> None:
    """In a forked rank: torchrun's variables (none where ``rank`` is None: a plain process),
    then the entry script, ``-m`` module or ``-c`` code as ``__main__``; never returns."""
    import runpy
    import threading
    import traceback

    n = req["nproc"]
    if rank is not None:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                          LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                          ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(n), ROLE_NAME="default",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                          TORCHELASTIC_RUN_ID="forked_ranks", TORCHELASTIC_USE_AGENT_STORE="True")
    entry, module, source = req.get("entry"), req.get("module"), req.get("code")
    if module or source is not None:
        sys.argv = ["-m" if module else "-c", *req["args"]]
        sys.path[0] = os.getcwd()
    else:
        sys.argv = [entry, *req["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(entry))
    code = 0
    try:
        if source is not None:
            exec(compile(source, "<string>", "exec"), {"__name__": "__main__"})
        elif module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(entry, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:                       # sys.exit("message"): printed, exit status 1
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:   # what the interpreter does at exit: join threads, then atexit
        threading._shutdown()
        import atexit
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _agent_store(port: int):
    """The job's store, hosted by the leader as torchrun's agent hosts it
    (``TORCHELASTIC_USE_AGENT_STORE``: the ranks connect as clients; they retry until it is up)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=300))


def _lead(req: dict, out_fd: int, err_fd: int) -> None:
    """In the forked job leader: its own session, the client's stdout and stderr, the ranks
    forked and watched; exits 0, or 1 when a rank failed (as torchrun does); a plain process's
    leader ends as the process did (its exit code, or its signal), as ``subprocess.run`` sees
    an interpreter end."""
    os.setsid()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd in {out_fd, err_fd, null}:
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    port = _free_port()
    ranks = {}
    for rank in range(req["nproc"]) if req["nproc"] else [None]:
        pid = os.fork()
        if pid == 0:
            _run_rank(req, rank, port)
        ranks[pid] = 0 if rank is None else rank
    store = _agent_store(port) if req["nproc"] else None   # after the forks: its thread is ours
    failed, kill_at = None, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                _signal(ranks, signal.SIGKILL)
                kill_at = None
            time.sleep(0.05)
            continue
        rank = ranks.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if not req["nproc"] and rank is not None:   # a plain process: its own status
            if code < 0:                            # killed by a signal: so is the leader
                if -code != signal.SIGKILL:
                    signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code)
        if rank is not None and code != 0 and failed is None:
            failed = rank
            sys.stderr.write(f"forked_ranks: rank {rank} exited with {code}; stopping the "
                             f"other ranks\n")
            _signal(ranks, signal.SIGTERM)
            kill_at = time.monotonic() + STOP_GRACE_S
    sys.stderr.flush()
    del store
    os._exit(0 if failed is None else 1)


def _warm_pure_caches() -> None:
    """What every entry rank computed again with the same result, computed once here for the
    ranks to inherit: megatron's field docstrings (``ArgumentGroupFactory._get_field_docstrings``
    reads the source of each config dataclass and parses it, at both of ``pretrain()``'s
    ``parse_args``, the second for fault tolerance: about 0.17 s of a short run's rank's 0.8 s
    of CPU), memoized per class and filled by building Megatron's arguments once. They are help
    text, the same for a class whichever process reads its source; a class met first in a rank
    is read there."""
    import argparse
    import functools

    from megatron.training import argument_utils, arguments

    factory = getattr(argument_utils, "ArgumentGroupFactory", None)
    parse = getattr(factory, "_get_field_docstrings", None)
    if parse is None or hasattr(parse, "__wrapped__"):
        return
    found: dict = {}

    @functools.wraps(parse)
    def memoized(self, src_cfg_class: type) -> dict:
        if src_cfg_class not in found:
            found[src_cfg_class] = parse(self, src_cfg_class)
        return dict(found[src_cfg_class])

    factory._get_field_docstrings = memoized
    build = getattr(arguments, "add_megatron_arguments", None)   # else filled by each rank
    if build is not None:
        build(argparse.ArgumentParser(allow_abbrev=False))


def serve(path: str) -> None:
    """Import megatron-core once, then launch the jobs the socket at ``path`` asks for."""
    import importlib
    import warnings

    # SB_FORKED_RANKS_LIGHT=1: no preload and a 0.2 s poll, for the launcher's own tests of
    # what the server does when idle (megatron-core is not what they test)
    light = os.environ.get("SB_FORKED_RANKS_LIGHT") == "1"
    with warnings.catch_warnings():   # the ranks' imports would print these; the server's don't
        warnings.simplefilter("ignore")
        for name in () if light else PRELOAD:
            importlib.import_module(name)
        if not light:    # the planner's numba kernels, loaded from their disk cache once here
            importlib.import_module("sparsebalance_megatron.kernels").warm_up()   # not per rank
            _warm_pure_caches()   # megatron's field docstrings, read once here
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    listener.settimeout(0.2 if light else PARENT_POLL_S)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:      # the pytest worker is gone (killed, interrupted)
                return
            continue
        conn.settimeout(None)
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            while not msg.endswith(b"\n"):
                more = conn.recv(1 << 20)
                if not more:
                    break
                msg += more
            req = json.loads(msg)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                try:
                    _lead(req, *fds)
                finally:
                    os._exit(1)
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
            except OSError:
                pass
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall((json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
                             .encode())
            except OSError:         # the client has gone (it timed out and killed the job)
                pass


# --- client side ---------------------------------------------------------------------------------

def _kill_job(leader: int) -> None:
    """SIGKILL to the job's process group; to its leader alone where the leader has not yet
    made its own session (its first act, before it forks a rank): a timeout that struck
    before then raised ProcessLookupError and left the job running."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except ProcessLookupError:
        _signal([leader], signal.SIGKILL)
        try:                      # ranks it forked in between, in the session it made
            os.killpg(leader, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch(path: str, entry, args: list, nproc: int, cwd, env: dict, out_fd: int, err_fd: int,
           timeout: float | None = None) -> int:
    """Run ``entry`` (a script, ``-m module`` or ``-c code``) on ``nproc`` forked ranks of the
    server at ``path`` (``nproc`` 0: one process without torchrun's variables), writing to
    ``out_fd`` and ``err_fd``; returns the job's exit status. Past ``timeout`` the job is
    killed and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    entry = str(entry)
    kind = {"-m ": "module", "-c ": "code"}.get(entry[:3], "entry")
    req = dict(args=[str(a) for a in args], nproc=nproc, cwd=str(cwd), env=env,
               **{kind: entry[3:] if kind != "entry" else entry})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        socket.send_fds(conn, [(json.dumps(req) + "\n").encode()], [out_fd, err_fd])
        replies = conn.makefile("r")
        pid = json.loads(replies.readline())["pid"]
        conn.settimeout(timeout)
        try:
            line = replies.readline()
        except TimeoutError:
            _kill_job(pid)
            raise subprocess.TimeoutExpired(["forked_ranks", str(entry)], timeout) from None
        except BaseException:
            _kill_job(pid)
            raise
        if not line:
            raise RuntimeError(f"forked_ranks: the server at {path} ended during the job")
        return json.loads(line)["rc"]


class Server:
    """This pytest process's server, started on first use (a dead one is started again).
    ``env``: the server's environment (None: this process's at start). The suite passes the one
    pytest started with: a test's monkeypatched variables (a ``PYTHONPATH``, a test switch) must
    not become every later launch's server, whichever test happens to start it."""

    def __init__(self, env: dict | None = None):
        self.proc = None
        self.path = None
        self.env = None if env is None else dict(env)

    def start(self) -> None:
        """Start the server unless it runs."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self.path = os.path.join(tempfile.mkdtemp(prefix="forked_ranks."), "socket")
        env = dict(os.environ if self.env is None else self.env, OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), "--serve", self.path],
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"forked_ranks: the server did not start ({self.proc.wait()})")

    def run(self, entry: Path | str, args: list, nproc: int, cwd: Path, env: dict,
            timeout: float) -> subprocess.CompletedProcess:
        """``launch``, with stdout and stderr merged, as ``subprocess.run`` with
        ``stderr=STDOUT`` returns them."""
        self.start()
        cmd = ["forked_ranks", f"--nproc_per_node={nproc}", str(entry), *map(str, args)]
        with tempfile.TemporaryFile("w+", errors="replace") as out:
            try:
                rc = launch(self.path, entry, args, nproc, cwd, env, out.fileno(), out.fileno(),
                            timeout)
            except subprocess.TimeoutExpired as e:
                out.seek(0)
                raise subprocess.TimeoutExpired(cmd, timeout, output=out.read()) from e
            out.seek(0)
            return subprocess.CompletedProcess(cmd, rc, stdout=out.read())

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        if self.path is not None:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


def main(argv: list) -> int:
    """torchrun's command line, for the server named in SB_FORKED_RANKS:
    ``[--standalone] --nproc_per_node=N ENTRY ARGS...``."""
    nproc, rest = 1, list(argv)
    while rest and rest[0].startswith("--"):
        opt = rest.pop(0)
        if opt.startswith("--nproc_per_node=") or opt.startswith("--nproc-per-node="):
            nproc = int(opt.split("=", 1)[1])
        elif opt in ("--nproc_per_node", "--nproc-per-node"):
            nproc = int(rest.pop(0))
        elif opt != "--standalone":
            raise SystemExit(f"forked_ranks: {opt}: not supported (only --standalone and "
                             f"--nproc_per_node)")
    path = os.environ.get(SOCKET_ENV)
    if not path or not rest:
        raise SystemExit(f"usage: {SOCKET_ENV}=SOCKET python tests/forked_ranks.py "
                         f"[--standalone] --nproc_per_node=N ENTRY ARGS...")
    return launch(path, rest[0], rest[1:], nproc, os.getcwd(), dict(os.environ), 1, 2)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        sys.exit(main(sys.argv[1:]))
