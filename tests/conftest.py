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


@pytest.fixture(scope="session")
def tiny_latency_table(tmp_path_factory) -> Path:
    """A quick latency table for TINY_MODEL (the profiler CLI, as a user would run it)."""
    out = tmp_path_factory.mktemp("lat") / "lat.json"
    cmd = [sys.executable, "-m", "sparsebalance_megatron.megatron.profile_cli", "--quick",
           "--no-progress", "--out", str(out), "--num-layers", "4", "--hidden-size", "64",
           "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "2",
           "--vocab-size", "384", "--seq-length", "256", "--sb-block-size", "32",
           "--mixes", "3", "--densities", "0.25", "1.0", "--repeats", "1"]
    subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return out


def run_entry(nproc: int, args: list, *, cwd: Path, timeout: int = 300, check: bool = True):
    """torchrun the training entry; returns the CompletedProcess (stdout+stderr merged)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(ENTRY), *map(str, args)]
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_scalars(tb_dir: Path) -> dict:
    """{tag: {iteration: value}} from the TensorBoard event files Megatron's writer left."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
