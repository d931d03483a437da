"""The plugin's resume state inside Megatron's checkpoint folder of an iteration.

Saving goes through Megatron's own hook for external data loaders: with ``args.dataloader_save``
set to ``--save`` (``hooks.install``), every ``save_checkpoint`` calls the train iterator's
``save_state()`` and writes it to ``<save>/iter_NNNNNNN/mp_rank_00[_000]/train_dataloader_dprankNNN.pt``
before it writes ``latest_checkpointed_iteration.txt``, so a checkpoint that Megatron resumes from
always has its plugin state next to the weights. With the interleaved schedule (model chunks)
that hook cannot run: megatron-core's ``maybe_save_dataloader_state`` reads ``.iterable`` of the
one iterator it is given and ``train()`` gives it the list of the chunks' iterators (0.19.2,
0.20 / Megatron-LM main and dev alike). There ``save_at_checkpoints`` writes the same file itself
(``write_state_file``: the same ranks, names and format, written atomically) when Megatron starts
its checkpoint save: ``save_checkpoint_and_time`` starts its ``save-checkpoint`` timer before
``save_checkpoint`` writes anything, and the tracker file comes after every rank's save.

``load_plugin_state`` reads it back (the rank's DP rank's file, else DP rank 0's) with errors
that name the file; ``restore_saved_state`` loads it into the callback. With --sb-fresh-state a missing or
damaged state starts the balancer fresh (a warning names the file); a state without the
balancer's parts (a dense run's checkpoint) starts them fresh with one line saying so.

The file is read with ``torch.load(weights_only=True)``, which refuses anything but plain Python
types, tensors and allowlisted classes. ``plain_state`` is the one place that makes the saved
state plain (the callback's ``state_dict`` returns through it): numpy and torch scalars and
arrays become int/float/bool/lists, tuples lists, and anything else is refused at save time
naming its field, so a checkpoint never holds what the resume cannot read. Checkpoints written
before it (PP >= 2 ones held numpy float64 stage corrections) are read by allowing exactly the
numpy reconstructors of numeric scalars (``_numpy_scalars_allowed``) and converted the same way.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Optional

import numpy as np
import torch

from ..errors import LaunchError

STATE_VERSION = 1   # of the dict SparseBalanceCallback.state_dict writes


def state_file_path(checkpoint_dir: str, iteration: int, *, pipeline_parallel: bool,
                    dp_rank: int) -> str:
    """Where Megatron's ``--dataloader-save`` hook puts DP rank ``dp_rank``'s state for the
    checkpoint of ``iteration``: the TP 0 / PP 0 folder of ``iter_NNNNNNN``."""
    from megatron.training.checkpointing import get_checkpoint_name

    return get_checkpoint_name(checkpoint_dir, iteration, pipeline_parallel=pipeline_parallel,
                               tensor_rank=0, pipeline_rank=0, expert_parallel=False,
                               expert_rank=0, basename=f"train_dataloader_dprank{dp_rank:03d}.pt")


def plugin_state_path(args, load_dir: str, iteration: int, dp_rank: int = 0) -> str:
    """The state file a resume reads: DP rank ``dp_rank``'s (a rank's sensitivity tracker and
    plan-ahead basis are its own: it learns its own documents), else DP rank 0's (a resume on
    more DP ranks than saved). Its folder is named by the pipeline of the run that saved it
    (``mp_rank_00`` or ``mp_rank_00_000``): a resume on another pipeline
    (``step/relayout.py``) reads the other where this run's is missing."""
    pp = args.pipeline_model_parallel_size > 1
    ranks = (dp_rank, 0) if dp_rank else (0,)
    found = [state_file_path(load_dir, iteration, pipeline_parallel=p, dp_rank=r)
             for r in ranks for p in (pp, not pp)]
    return next((f for f in found if os.path.exists(f)), found[-1 if dp_rank else 0])


def write_state_file(path: str, state: dict) -> None:
    """``state`` in Megatron's format (``{"dataloader_state_dict": state}``) at ``path``,
    atomically: written to a temporary file in the same folder, synced, then renamed over
    ``path``, so a crash leaves the previous file or none, never part of one."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save({"dataloader_state_dict": state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


# The timers Megatron's save_checkpoint_and_time starts before save_checkpoint (persistent and
# non-persistent saves); the dataloader hook writes for both, so does save_at_checkpoints.
SAVE_TIMERS = ("save-checkpoint", "save-checkpoint-non-persistent")


class _SavingTimer:
    def __init__(self, timer, save):
        self._timer, self._save = timer, save

    def start(self, *args, **kwargs):
        self._save()
        return self._timer.start(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._timer, name)


class StateSavingTimers:
    """Megatron's ``Timers`` whose checkpoint-save timers (``SAVE_TIMERS``) call ``save()``
    before they start; everything else is Megatron's."""

    def __init__(self, timers, save):
        self.timers, self.save = timers, save

    def __call__(self, name, *args, **kwargs):
        timer = self.timers(name, *args, **kwargs)
        return _SavingTimer(timer, self.save) if name in SAVE_TIMERS else timer

    def __getattr__(self, name):
        return getattr(self.timers, name)


def save_at_checkpoints(tee, cb) -> None:
    """Interleaved schedule: every checkpoint save of Megatron's writes ``cb``'s (the
    ``SparseBalanceCallback``'s) state where the ``--dataloader-save`` hook would have, for this
    rank's DP rank, at the start of the save. ``tee`` is Megatron's global timers (``hooks``' tee);
    its Megatron half becomes ``StateSavingTimers`` (idempotent), inside the watchdog's phase
    timers, so the write counts as the checkpoint save. Call it on the ranks that write
    Megatron's data loader state: the first pipeline stage, TP rank 0 (and CP rank 0)."""

    def save():
        state = cb.state_dict()
        args = cb.args
        write_state_file(state_file_path(args.save, state["iteration"],
                                         pipeline_parallel=args.pipeline_model_parallel_size > 1,
                                         dp_rank=cb.dp_rank), state)

    inner = tee.megatron_timers
    if isinstance(inner, StateSavingTimers):
        inner.save = save
    else:
        tee.megatron_timers = StateSavingTimers(inner, save)


_NUMERIC_KINDS = "biuf"     # numpy dtype kinds a state may hold: bool, int, unsigned, float


def plain_state(value, where: str = "state"):
    """``value`` as plain Python types (None, bool, int, float, str; lists; dicts with str or int
    keys), what ``torch.load(weights_only=True)`` reads on every torch and numpy version.

    numpy and torch numeric scalars become int/float/bool, their arrays (nested) lists, tuples
    and deques lists. Anything else raises ``TypeError`` naming the field (``where``, e.g.
    ``state['latency']['stage_corrections']['0,1']``) and its type: a state that would not
    resume is refused when it is saved, not when the run is resumed."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)                          # numpy.str_ is a str that numpy pickles
    if isinstance(value, int):
        return int(value)                          # an int subclass (IntEnum) as a plain int
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (np.generic, np.ndarray)) and value.dtype.kind in _NUMERIC_KINDS:
        return value.tolist()                      # scalar -> bool/int/float; array -> lists
    if isinstance(value, torch.Tensor) and not (value.is_complex() or value.is_quantized):
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int, np.integer)) or isinstance(k, bool):
                raise TypeError(f"{where}: key {k!r} ({type(k).__name__}): a key of the "
                                f"plugin's checkpoint state must be a str or an int")
            out[str(k) if isinstance(k, str) else int(k)] = plain_state(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple, deque)):
        return [plain_state(v, f"{where}[{i}]") for i, v in enumerate(value)]
    kind = type(value).__module__ + "." + type(value).__qualname__
    raise TypeError(f"{where}: {kind} {value!r:.80}: the plugin's checkpoint state holds only "
                    f"None, bool, int, float, str, lists and dicts (numpy/torch numbers are "
                    f"converted); convert it where the state is built")


def _numpy_scalars_allowed():
    """``torch.load(weights_only=True)`` allowing numpy's numeric scalars (bool, ints, floats)
    and nothing else of numpy: what checkpoints of the landed version hold (numpy float64
    stage corrections). Their reconstructor under both numpy 1 and numpy 2 names; arrays,
    strings and object scalars stay refused."""
    scalar = np.float64(0).__reduce__()[0]        # numpy's own scalar reconstructor
    dtypes = [type(np.dtype(t)) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64,
                                           np.uint8, np.uint16, np.uint32, np.uint64,
                                           np.float16, np.float32, np.float64)]
    allowed = [(scalar, "numpy.core.multiarray.scalar"),
               (scalar, "numpy._core.multiarray.scalar"), np.dtype, *dtypes]
    return torch.serialization.safe_globals(allowed)


def read_state_file(path: str) -> dict:
    """The plugin state in ``path`` (Megatron's ``{"dataloader_state_dict": state}``) as plain
    Python types; a file of the landed version (numpy scalars in it) reads the same. Raises
    what ``torch.load`` or ``plain_state`` raise on a damaged or foreign file."""
    with _numpy_scalars_allowed():
        saved = torch.load(path, map_location="cpu", weights_only=True)
    return plain_state(saved["dataloader_state_dict"])


def load_plugin_state(args, load_dir: str, iteration: int, *, fresh: bool = False,
                      dp_rank: int = 0):
    """The state the callback saved with the checkpoint of ``iteration`` (``plugin_state_path``
    of ``dp_rank``); None (start the balancer fresh) when it is missing or damaged and ``fresh``
    (--sb-fresh-state) says so, with a warning naming the file; else a ``LaunchError`` naming
    the file and both ways out."""
    path = plugin_state_path(args, load_dir, iteration, dp_rank)
    if not os.path.exists(path):
        if fresh:
            from ..runtime.comm import say
            say(f"no SparseBalance state at {path}: starting the balancer fresh "
                f"(--sb-fresh-state)")
            return None
        raise LaunchError(
            f"resuming iteration {iteration} from {load_dir}: no SparseBalance state at {path} "
            f"(the checkpoint was written without the plugin's data path, or with the "
            f"interleaved schedule by a plugin version that could not save it there); pass "
            f"--sb-fresh-state to start the balancer fresh, or load the weights with "
            f"--finetune")
    try:
        state = read_state_file(path)
        version, it = int(state["version"]), int(state["iteration"])
        problem = None
    except Exception as e:  # truncated, not a dict, missing keys
        problem = f"cannot be read ({type(e).__name__}: {e}); the checkpoint is damaged"
    else:
        if version != STATE_VERSION:
            problem = f"has version {version}, this plugin reads version {STATE_VERSION}"
        elif it != iteration:
            problem = f"belongs to iteration {it}, the checkpoint is iteration {iteration}"
    if problem is None:
        return state
    return damaged_state(path, problem, fresh)


def damaged_state(path: str, problem: str, fresh: bool) -> None:
    """A state file that exists but cannot serve the resume: with ``fresh`` (--sb-fresh-state)
    a warning naming the file (rank 0) and None (start fresh); else the refusal, which says how
    to go on."""
    if fresh:
        from ..runtime.comm import say
        say(f"warning: SparseBalance state {path} {problem}: starting the balancer fresh "
            f"(--sb-fresh-state)")
        return None
    raise LaunchError(f"SparseBalance state {path} {problem}; pass --sb-fresh-state to start "
                      f"the balancer fresh (latency calibration, sensitivities), or restore the "
                      f"file from a copy of the checkpoint")


def note_missing_parts(state: dict, *, latency: bool, sensitivity: bool, path: str) -> None:
    """A checkpoint whose state holds no balancer state for a part this run has (one written by
    a dense or static run, DST/SAB off): say once (rank 0) that the part starts fresh."""
    parts = [name for name, have, key in (("latency calibration", latency, "latency"),
                                          ("sensitivities", sensitivity, "sensitivity"))
             if have and state.get(key) is None]
    if parts:
        from ..runtime.comm import say
        say(f"the checkpoint's SparseBalance state {path} holds no {' or '.join(parts)} (written "
            f"by a run without DST/SAB): the balancer starts fresh")


def restore_saved_state(cb):
    """(state, plan-ahead basis present) of the checkpoint ``cb`` (the ``SparseBalanceCallback``)
    resumes, loaded into its latency model and tracker; (None, False) when it starts fresh;
    ``LaunchError`` naming the file when the state is missing or damaged (without
    --sb-fresh-state)."""
    args = cb.args
    if cb.latency is None and cb.tracker is None:
        return None, False                       # nothing to restore
    dp_rank = cb.dp_rank
    state = _relayout(cb, load_plugin_state(args, args.load, args.iteration,
                                            fresh=cb.sb.fresh_state, dp_rank=dp_rank))
    ahead = bool(cb.sb.plan_ahead and state is not None and state.get("ahead_basis"))
    path = plugin_state_path(args, args.load, args.iteration, dp_rank)
    fresh = cb._state_basis()
    try:
        if ahead:       # the state itself is loaded once the first step is prepared: checked now
            cb.load_state_dict(state)
        # plan-ahead: the first step is re-planned from the state it was planned from
        cb.load_state_dict(dict(state, **state["ahead_basis"]) if ahead else state)
    except (ValueError, KeyError, TypeError) as e:
        damaged_state(path, f"cannot be loaded ({type(e).__name__}: {e})",
                      cb.sb.fresh_state)          # refuses without --sb-fresh-state
        cb.load_state_dict(fresh)                 # undo a partial load
        return None, False
    if state is not None:
        note_missing_parts(state, latency=cb.latency is not None,
                           sensitivity=cb.tracker is not None, path=path)
    return state, ahead


def _relayout(cb, state: Optional[dict]) -> Optional[dict]:
    """``state`` kept where it applies to this run's layout (``step/relayout.py``), said in one
    line (rank 0) where the layout changed."""
    if state is None:
        return None
    from ..runtime.comm import say
    from .relayout import layout_record, relayout

    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        m = get_num_microbatches()
    except (ImportError, AttributeError):        # no calculator set up: not compared
        m = None
    state, line = relayout(state, layout_record(cb.dp, cb.pp, cb.vp, m),
                           latency=cb.latency is not None, sensitivity=cb.tracker is not None)
    if line:
        say(line)
    return state
