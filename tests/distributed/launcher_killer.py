"""``python launcher_killer.py LINE NPROC ENTRY ARGS...``: torchrun ``ENTRY`` on ``NPROC`` ranks,
SIGKILL torchrun itself once a line of the job's output contains ``LINE``, then reap the workers
it left (this process is their subreaper, so their exit status is known) and print one JSON line:
``{"workers": {pid: exit code}, "others": {pid: exit code}, "killed": bool}``: torchrun's own
children, then whatever else of theirs outlived them (tests/distributed/test_edges.py)."""

import ctypes
import json
import os
import signal
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def children_of(pid: int) -> set:
    """The pids whose parent is ``pid`` (also tests/distributed/test_watchdog.py's)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.add(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out

if __name__ == "__main__":
    line, nproc, *cmd = sys.argv[1:]
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("prctl(PR_SET_CHILD_SUBREAPER) failed")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={nproc}", *cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    killed, workers = False, set()
    for out in proc.stdout:
        sys.stdout.write(out)
        if not killed and line in out:
            workers = children_of(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            killed = True
            print("[test] torchrun killed (SIGKILL)", flush=True)
    codes = {}
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid != proc.pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
    print(json.dumps({"workers": {p: c for p, c in codes.items() if p in workers},
                      "others": {p: c for p, c in codes.items() if p not in workers},
                      "killed": killed}), flush=True)
