"""Fixtures shared by unit tests: the latency-table tests' table, and ``interp`` (a module's
checks run in the session's TRITON_INTERPRET worker process)."""

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sparsebalance_megatron.latency import ModelShape, analytic_table


@pytest.fixture
def table():
    """A PP=2 analytic latency table (4 layers, 4,096 tokens), fresh for every test."""
    return analytic_table(ModelShape(num_layers=4, seq_length=4096), pp=2)


def write_table(tmp_path, obj, name="t.json") -> str:
    """Write ``obj`` (a dict as JSON, or a string as is) to ``tmp_path / name``; return the path."""
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(p)


_REPO = Path(__file__).resolve().parents[2]
_WORKER = """
import importlib.util, json, os, sys, traceback
sys.path.insert(0, sys.argv[1])
from tests.unit._interpreter import skip_dead_overflow_checks
skip_dead_overflow_checks()
modules = {}
for line in sys.stdin:
    if line == "stop\\n":
        break
    path, name, kw = json.loads(line)
    try:
        if path not in modules:
            spec = importlib.util.spec_from_file_location(
                "interp_checks_" + os.path.basename(path)[:-3], path)
            modules[path] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[path])
        getattr(modules[path], name)(**kw)
        res = "OK"
    except BaseException:
        res = traceback.format_exc()
    print("@@RESULT " + json.dumps(res), flush=True)
os._exit(0)     # stopped: skip the interpreter's teardown (a second or more of torch's)
"""


class _InterpWorker:
    """The ``TRITON_INTERPRET=1`` process the ``interp`` checks run in, started at the first check
    and again after one that ended it; each test module's file is loaded in it once."""

    def __init__(self):
        self.proc = None

    def call(self, path: str, name: str, kw: dict) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps([path, name, kw]) + "\n")
        self.proc.stdin.flush()
        seen = []
        while True:
            try:
                line = self.lines.get(timeout=300)
            except queue.Empty:
                self.proc.kill()
                pytest.fail(f"{name}: no answer from the interpreter worker in 300 s")
            if not line:
                pytest.fail(f"{name}: the interpreter worker died:\n{''.join(seen)[-3000:]}")
            if line.startswith("@@RESULT "):
                res = json.loads(line[len("@@RESULT "):])
                assert res == "OK", f"{name}({kw}) failed in the interpreter:\n{res}"
                return
            seen.append(line)

    def _start(self) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(_REPO))
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(_REPO)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=str(_REPO))
        self.lines = lines = queue.Queue()   # a reader thread: select() would miss buffered lines
        out = self.proc.stdout

        def read():
            for line in out:
                lines.put(line)
            lines.put("")                         # end of output: the worker is gone
        threading.Thread(target=read, daemon=True).start()

    def close(self) -> None:
        """Stop it by a word, not by its stdin's end: a process forked from this one meanwhile
        (the rank server) holds a copy of the pipe's write end."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="session")
def _interp_worker():
    worker = _InterpWorker()
    yield worker
    worker.close()


@pytest.fixture(scope="module")
def interp(request, _interp_worker):
    """``run(check_name, **kwargs)``: calls the test module's function ``check_name`` in the
    session's worker process started with ``TRITON_INTERPRET=1``, and asserts it passed.

    Triton decides at decoration time whether a kernel is interpreted, so kernels that must run
    on CPU are imported there (whatever this process imported before is untouched). The worker
    loads the requesting test file itself, once; a check fails the test with the worker's
    traceback. One worker serves every module of the session (a fresh interpreter importing
    torch and triton, about 1.6 s of CPU, once; a new one where a check ended it). The
    interpreter's int32 overflow checks, which it computes and then drops, are skipped
    (``tests/unit/_interpreter.py``)."""
    pytest.importorskip("triton")
    path = str(request.module.__file__)

    def run(name, **kw):
        _interp_worker.call(path, name, kw)

    return run
