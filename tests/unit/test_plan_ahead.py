"""The planners that draft step n+1 while step n trains (``step/ahead.py``): the draft comes
back to the training thread, and so does an error raised while drafting (a bad batch must stop
the run, not vanish with the thread or the process); in-line, on the planner thread and in the
planner process the same inputs give the same plan, bit for bit."""

from __future__ import annotations

import copy
import pickle
import threading

import numpy as np
import pytest

from sparsebalance_megatron.megatron.step.ahead import Planner, PlannerProcess
from sparsebalance_megatron.megatron.step.drafting import Draft, Drafter


def test_planner_returns_the_draft_with_its_basis():
    seen = []

    def draft():
        seen.append(threading.current_thread().name)
        return Draft(iteration=3, first_bin=12, batch=None, units=None, payload=None)

    planner = Planner(draft, basis={"latency": {"errors": [0.1]}})
    out = planner.result()
    assert planner.done()                                  # made: result() would not wait
    assert (out.iteration, out.first_bin) == (3, 12)
    assert out.basis == {"latency": {"errors": [0.1]}}
    assert seen == ["sparsebalance-planner"]


def test_planner_reraises_the_drafts_error_on_the_caller():
    def draft():
        raise ValueError("sample 7: 40000 tokens, expected <= 32768")

    with pytest.raises(ValueError, match="sample 7: 40000 tokens"):
        Planner(draft, basis={}).result()


DP, M, SEQ = 4, 8, 8192


@pytest.fixture(scope="module")
def steps():
    """Three global batches of the built-in corpus and a PP=2 analytic latency model."""
    from sparsebalance_megatron.experiments.corpus_steps import corpus_steps

    return corpus_steps(DP, M, 0.5, 3, seq=SEQ, pp=2)


def _drafter(lm, tracker, **sb_kw):
    from sparsebalance_megatron.config import SparseBalanceConfig

    sb = SparseBalanceConfig(sparse_balance=True, **sb_kw)
    return Drafter(sb, lm, tracker, dp=DP, capacity=SEQ,
                   attention_layers=lm.layout.attention_layers)


def _learn(lm, tracker, step: int):
    """A step's measurements: per-(DP rank, stage) calibration and document losses."""
    rng = np.random.default_rng(step)
    for r in range(DP):
        lm.calibrate(r, np.ones(2), rng.uniform(0.8, 1.6, 2))
        lm.calibrate_stages(r, np.ones(2), rng.uniform(0.8, 1.4, 2))
    ids = list(range(step * 20, step * 20 + 20))
    lengths, losses = rng.integers(100, 8000, 20).tolist(), rng.uniform(1, 4, 20).tolist()
    return ids, lengths, losses


def _index(d: Draft, plan_of: Draft) -> int:
    """The packing the step commits, as the broadcast of ``plan_of``'s plan says."""
    stand = (plan_of.payload[1] if plan_of.payload else {}).get("stand_down") or d.stand_down
    return 1 if stand and stand["packing_index"] == 1 else 0


def _plain(d: Draft, plan_of: Draft = None) -> bytes:
    """A draft's content (not its CPU time or basis) as bytes to compare: the packing it commits
    (the baseline's where SAB stood down), its features and its plan."""
    batch, units = d.packing(_index(d, plan_of or d))
    return pickle.dumps((d.iteration, d.first_bin, d.num_microbatches, d.payload,
                         list(batch.micro_batches), d.stand_down,
                         units.work_grid(np.array([0.25, 0.5, 1.0]))))


@pytest.mark.parametrize("objective", ["quality", "density"])
def test_inline_thread_and_process_draft_the_same_plan(steps, objective,
                                                       lenient_draft_deadline):
    from sparsebalance_megatron.batching import SensitivityTracker

    lm, tracker = copy.deepcopy(steps.lm), SensitivityTracker()
    drafter = _drafter(lm, tracker, dst_objective=objective)
    proc = PlannerProcess(drafter)              # a copy of the state before any step
    try:
        synced = False
        for k, segs in enumerate(steps.segments):
            ids, lengths, losses = _learn(lm, tracker, k)
            tracker.update(ids, lengths, losses)
            inline = drafter.draft(k, 100 * k, segs, M, with_dst=True)
            thread = Planner(lambda: drafter.draft(k, 100 * k, segs, M, with_dst=True),
                             basis={}).result()
            sync = ("updates", [(ids, lengths, losses)]) if synced else \
                ("reset", tracker.state_dict())
            synced = True
            ahead = proc.submit(k, 100 * k, segs, M, with_dst=True,
                                latency_state=lm.calibration_state(), tracker_sync=sync,
                                basis={"k": k}).result()
            assert ahead.basis == {"k": k} and ahead.cpu_s > 0
            assert inline.payload is not None and inline.baseline is not None
            # only the packing the plan commits comes back
            index = ahead.payload[1]["stand_down"]["packing_index"]
            assert (ahead.baseline is None) == (index == 0)
            assert (ahead.batch is None) == (index == 1)
            assert _plain(inline) == _plain(thread) == _plain(ahead), f"step {k}"
            # the committed plan's busy seconds travel with it: what calibration would predict
            units = inline.packing(index)[1]
            assert inline.payload[1]["predicted_busy_s"] == \
                lm.busy_s(units, np.asarray(inline.payload[0])).tolist()
            # a rank that does not plan DST gets both packings: rank 0's broadcast says which
            pending = proc.submit(k, 100 * k, segs, M, with_dst=False, latency_state=None,
                                  tracker_sync=("updates", []), basis={})
            other = pending.result()
            assert pending.done()
            assert other.batch is not None and other.baseline is not None
            ref = drafter.draft(k, 100 * k, segs, M, with_dst=False)
            assert _plain(other, ahead) == _plain(ref, ahead), f"step {k}"
        # the learned state moved the plans: the last step differs from a fresh drafter's
        fresh = _drafter(copy.deepcopy(steps.lm), SensitivityTracker(),
                         dst_objective=objective).draft(2, 200, steps.segments[2], M,
                                                         with_dst=True)
        assert _plain(fresh) != _plain(inline)
    finally:
        proc.close()
    assert proc.proc.poll() is not None           # closing ends the process


def test_the_planner_process_imports_no_torch():
    """What the planner process imports (its module, the Drafter it unpickles, what a draft
    uses) stays numpy and the pure layers: a process of its own costs no torch start-up."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from sparsebalance_megatron.megatron.step import planner_worker\n"
            "from sparsebalance_megatron.latency import LatencyModel\n"
            "from sparsebalance_megatron.batching import SensitivityTracker\n"
            "planner_worker._import_draft_modules()\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out


def test_the_planner_process_freezes_what_it_holds_before_it_says_ready(monkeypatch):
    """Once ready, what the planner process holds is out of the garbage collector's reach
    (``gc.freeze``), so a full collection inside a draft walks only what drafts made (it walked
    ~100,000 objects, 20-40 ms, every few drafts). ``serve`` runs here on a thread over real
    pipes; the draft modules' import is skipped (what it does is tested above)."""
    import gc
    import os
    from multiprocessing.connection import Connection

    from sparsebalance_megatron.megatron.step import planner_worker

    monkeypatch.setattr(planner_worker, "_import_draft_modules", lambda: None)
    (r_in, w_in), (r_out, w_out) = os.pipe(), os.pipe()
    to_child, from_child = Connection(w_in, readable=False), Connection(r_out, writable=False)
    worker = threading.Thread(target=planner_worker.serve, args=(Connection(r_in, writable=False),
                                                        Connection(w_out, readable=False)))
    gc.unfreeze()
    worker.start()
    try:
        to_child.send(("init", None))
        assert from_child.recv() == ("ready",)
        assert gc.get_freeze_count() > 1000
    finally:
        to_child.send(("stop",))
        worker.join(timeout=30)
        gc.unfreeze()
    assert not worker.is_alive()


def test_the_saved_basis_is_the_state_each_draft_started_from():
    """The plan-ahead basis a checkpoint saves (``StepPlanning.ahead_basis``) equals the
    tracker's and calibration's state when the prepared step's draft started, though the tracker
    is copied only at start and at the save (its copy replays the updates one draft behind),
    through a reload of the tracker too (a resume)."""
    import types
    from types import SimpleNamespace

    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.latency import LatencyModel
    from sparsebalance_megatron.megatron.step.planning import StepPlanning

    cb = SimpleNamespace(latency=LatencyModel.analytic(pp=2), tracker=SensitivityTracker(),
                         _process=None, _tracker_log=[], _tracker_synced=False, _updates=0,
                         _basis_tracker=None, _basis_log=[], _basis_mark=0, _ready_basis=None,
                         _drafter=SimpleNamespace(quality_scales=None))
    for name in ("_lagged_basis", "_advance_basis", "ahead_basis", "_track", "_tracker_loaded",
                 "_planning_state", "_quality_scales"):
        setattr(cb, name, types.MethodType(getattr(StepPlanning, name), cb))
    rng = np.random.default_rng(5)
    pending, expected = None, None
    for step in range(6):
        if step == 3:      # a resumed process: it loads the state wholesale, nothing pending
            cb.tracker.load_state_dict(cb.tracker.state_dict())
            cb._tracker_loaded()
            pending = None
        basis, want = cb._lagged_basis(), copy.deepcopy(cb._planning_state())
        if pending is not None:                        # end_step: the pending draft committed
            cb._advance_basis(pending)
            cb._ready_basis = pending
            assert cb.ahead_basis() == expected, f"step {step}"
        pending, expected = basis, want
        for _ in range(2):                             # the step's measurements
            cb._track(rng.integers(0, 50, 8).tolist(), rng.integers(100, 4000, 8).tolist(),
                      rng.uniform(1, 4, 8).tolist())
            cb.latency.calibrate(step % 2, np.ones(2), rng.uniform(0.8, 1.5, 2))
        cb._drafter.quality_scales = (1.0 + step, 0.5)     # a quality refresh after the step
    assert cb._updates == 12 and len(cb._basis_log) <= 4     # the copy stays one draft behind


def test_what_the_planner_process_sends_back():
    """A draft that holds the whole step's DST plan gets back the packing its plan commits only;
    one without it (a run's: every rank agrees DST after the draft) gets both
    (``planner_worker.reply``)."""
    from sparsebalance_megatron.megatron.step.planner_worker import reply

    sab, base = ("sab batch", "sab units"), ("base batch", "base units")
    for index in (0, 1):
        report = {"stand_down": {"packing_index": index}}
        planner = reply(Draft(3, 0, *sab, payload=([[0.5]], report), baseline=base,
                              options=2, num_microbatches=4))
        assert planner.packing(index) == (sab, base)[index]
        with pytest.raises(RuntimeError, match="not kept"):
            planner.packing(1 - index)
    other = reply(Draft(3, 0, *sab, payload=None, baseline=base, options=2,
                        num_microbatches=4))
    assert (other.packing(0), other.packing(1)) == (sab, base)
    one = reply(Draft(3, 0, *sab, payload=None, options=1, num_microbatches=4))
    assert one.packing(0) == sab
    with pytest.raises(ValueError, match="the draft has 1 packing"):
        one.packing(1)


def test_the_draft_is_read_back_before_the_step_ends(steps):
    """The planner process's draft is read by a reader thread as soon as it is made, while the
    step trains: ``result`` at the step's end only joins it (nothing left to read)."""
    from sparsebalance_megatron.batching import SensitivityTracker

    proc = PlannerProcess(_drafter(copy.deepcopy(steps.lm), SensitivityTracker()))
    try:
        pending = proc.submit(0, 0, steps.segments[0], M, with_dst=True, latency_state=None,
                              tracker_sync=None, basis={})
        pending._thread.join(timeout=120)          # the step trains; no result() asked yet
        assert not pending._thread.is_alive() and pending._draft is not None
        assert pending.recv_s > 0
        with pytest.raises(RuntimeError, match="still pending"):
            proc.submit(1, 0, steps.segments[1], M, with_dst=True, latency_state=None,
                        tracker_sync=None, basis={})
        assert pending.result() is pending._draft
    finally:
        proc.close()


def test_the_assignment_check_catches_a_dropped_duplicated_or_moved_segment():
    """``check_assignment`` compares the packing's segments with the step's as multisets
    (sorted rows): a packing that drops, duplicates or changes a segment, or overfills a
    micro-batch, is refused; a reordered one is not."""
    from sparsebalance_megatron.batching.packing import sequential_plan
    from sparsebalance_megatron.batching.plan import BatchPlan, checked_segments
    from sparsebalance_megatron.megatron.step.checks import check_assignment, segment_counts

    segs = [(k, 0, 100 + 7 * k) for k in range(24)] + [(3, 200, 260)]
    plan = sequential_plan(segs, dp=2, num_microbatches=3, max_tokens=1024)
    for given in (None, segment_counts(segs), segment_counts(checked_segments(segs))):
        check_assignment(segs, plan, 1024, given)
    mbs = [[list(mb) for mb in rank] for rank in plan.micro_batches]
    mbs[0][0], mbs[1][2] = mbs[1][2], mbs[0][0]                  # reordered: still the step's
    check_assignment(segs, BatchPlan(mbs, "sequential", 1024), 1024)
    r, j = next((r, j) for r in range(2) for j in range(3) if mbs[r][j])
    first = mbs[r][j][0]
    for change in ("drop", "duplicate", "move"):
        bad = [[list(mb) for mb in rank] for rank in mbs]
        if change == "drop":
            bad[r][j].pop(0)
        elif change == "duplicate":
            bad[1 - r][0].append(first)
        else:
            bad[r][j][0] = (first[0], first[1] + 1, first[2])
        with pytest.raises(RuntimeError, match="dropped or duplicated"):
            check_assignment(segs, BatchPlan(bad, "sequential", 1024), 1024)
    with pytest.raises(RuntimeError, match="capacity 200"):
        check_assignment(segs, plan, 200)
    with pytest.raises(ValueError, match=r"\(0, 100\).*expected \(sample_id, start, end\)"):
        segment_counts([(0, 100)] + segs)
    with pytest.raises(ValueError, match="expected \\(sample_id, start, end\\)"):
        segment_counts([(0, 100), (1, 50), (2, 70)])               # six numbers, no triple
    assert segment_counts([]).shape == (0, 3)
