"""A rank of ``conftest.spawn``: ``spawned_rank.py FILE MODULE FUNCTION ARGS_JSON`` calls the
function ``FUNCTION`` of the test file ``FILE`` with ``(RANK, *ARGS)``, as
``torch.multiprocessing.spawn`` calls it in a fresh interpreter. The file is loaded as pytest
loaded it: named ``MODULE``, its folder and the repository first on ``sys.path``. Launched by
``run_entry``: forked from the server of ``forked_ranks.py`` (torch, megatron-core and the
plugin's step imported once), or under torchrun."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    path, module, name, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    sys.path[:0] = [str(path.parent), str(Path(__file__).resolve().parents[1])]
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    spec.loader.exec_module(mod)
    getattr(mod, name)(int(os.environ["RANK"]), *args)
