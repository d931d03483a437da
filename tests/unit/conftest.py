"""Fixtures shared by unit tests: the latency-table tests' table, and ``interp`` (a module's
checks run in one TRITON_INTERPRET worker process)."""

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
spec = importlib.util.spec_from_file_location("interp_checks", sys.argv[2])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
from tests.unit._interpreter import skip_dead_overflow_checks
skip_dead_overflow_checks()
for line in sys.stdin:
    name, kw = json.loads(line)
    try:
        getattr(mod, name)(**kw)
        res = "OK"
    except BaseException:
        res = traceback.format_exc()
    print("@@RESULT " + json.dumps(res), flush=True)
os._exit(0)     # stdin closed: skip the interpreter's teardown (a second or more of torch's)
"""


@pytest.fixture(scope="module")
def interp(request):
    """``run(check_name, **kwargs)``: calls the test module's function ``check_name`` in one
    worker process per module started with ``TRITON_INTERPRET=1``, and asserts it passed.

    Triton decides at decoration time whether a kernel is interpreted, so kernels that must run
    on CPU are imported there (whatever this process imported before is untouched). The worker
    loads the requesting test file itself; a check fails the test with the worker's traceback.
    The interpreter's int32 overflow checks, which it computes and then drops, are skipped
    (``tests/unit/_interpreter.py``)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(_REPO))
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(_REPO), request.module.__file__],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=str(_REPO))
    lines = queue.Queue()     # a reader thread: select() would miss lines already buffered

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put("")                         # end of output: the worker is gone
    threading.Thread(target=read, daemon=True).start()

    def run(name, **kw):
        proc.stdin.write(json.dumps([name, kw]) + "\n")
        proc.stdin.flush()
        seen = []
        while True:
            try:
                line = lines.get(timeout=300)
            except queue.Empty:
                proc.kill()
                pytest.fail(f"{name}: no answer from the interpreter worker in 300 s")
            if not line:
                pytest.fail(f"{name}: the interpreter worker died:\n{''.join(seen)[-3000:]}")
            if line.startswith("@@RESULT "):
                res = json.loads(line[len("@@RESULT "):])
                assert res == "OK", f"{name}({kw}) failed in the interpreter:\n{res}"
                return
            seen.append(line)

    yield run
    if proc.poll() is None:
        proc.stdin.close()
        proc.wait(timeout=60)
