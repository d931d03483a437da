"""A planner's draft as the runtime makes it, for the studies that time drafts: the runtime's
``Drafter`` and step ``k``'s draft on a thread or a planner process (``make_drafter``,
``submit_draft``; ``planner_ab`` runs the first in another checkout too, where one before this
module has it in ``studies/_drafts.py``), and one DP rank's planning on the per-rank path
(``control_plane``, ``planner_cost``): its thread CPU by phase (``rank_step``) and the DP group
it settles its draft with (``group_record``), every rank's rounds driven here in lockstep.
"""

from __future__ import annotations

import gc
import time

import numpy as np


def make_drafter(lm, sb, dp: int, seq: int):
    """The runtime's ``Drafter`` for ``sb`` on ``lm`` (``dp`` ranks, ``seq`` tokens a
    micro-batch), with a fresh sensitivity tracker."""
    from sparsebalance_megatron.batching import SensitivityTracker
    from sparsebalance_megatron.megatron.step.drafting import Drafter

    return Drafter(sb, lm, SensitivityTracker(signal=sb.sensitivity_signal), dp=dp,
                   capacity=seq, attention_layers=lm.layout.attention_layers)


def submit_draft(planner: str, drafter, proc, k: int, segs, m: int, with_dst: bool = True,
                 settle=None):
    """Start the draft of step ``k`` on ``planner`` ('process': ``proc``, a PlannerProcess);
    ``with_dst``: as the rank that plans DST (else as any other rank); ``settle``: (DP rank,
    a reducer standing in for its DP group): that rank's own draft, settled as the runtime's
    planner settles it (``PlannerProcess.submit(settle=)``; on a thread ``Drafter.settle``
    after the draft, as ``StepPlanning`` drafts there)."""
    from sparsebalance_megatron.megatron.step.ahead import Planner

    rank = None if settle is None else int(settle[0])
    if planner == "thread":
        def made():
            d = drafter.draft(k, 0, segs, m, with_dst=with_dst, rank=rank)
            if settle is not None:
                d.agreed = drafter.settle(d, rank=rank, agree=settle[1])
            return d
        return Planner(made, basis={})
    return proc.submit(k, 0, segs, m, with_dst=with_dst, rank=rank, settle=settle,
                       latency_state=drafter.latency.calibration_state(),
                       tracker_sync=("updates", []) if k else
                       ("reset", drafter.tracker.state_dict()), basis={})


def group_record(drafter, k: int, segs, m: int, rank: int) -> tuple:
    """(the DP group's answers to DP rank ``rank``'s rounds as ``relay.Rounds`` records them:
    [(signature, agreed)], in order; what every rank's settle returned, in rank order): step
    ``k``'s own draft of every rank settled in lockstep from ``drafter``'s state (the group a
    run's rank settles with; its planner's settle answered from the record by
    ``relay.ReplayingReducer`` asks the same rounds)."""
    from sparsebalance_megatron.megatron.step.relay import signature
    from sparsebalance_megatron.policy.dst_rounds import plan_rounds_in_process

    log = []
    gens = [drafter.settle_rounds(drafter.draft(k, 0, segs, m, with_dst=False, rank=r), rank=r)
            for r in range(drafter.dp)]
    gens[rank] = _recorded(gens[rank], lambda parts, agreed: log.append((signature(parts),
                                                                          agreed)))
    return log, plan_rounds_in_process(gens)


def beyond_the_group(parts):
    """The live reducer past a recorded group's rounds: a rank that asks more rounds than its
    group made is a RuntimeError (its draft is not the one the group settled)."""
    raise RuntimeError(f"the rank asked a round its DP group did not make: {parts!r:.200}")


OWN = ("own_draft", "sab.rank_plan", "features", "sensitivity", "unit_costs")


def _timed(out: dict, key: str, f, *args, repeats: int = 3, **kw):
    """``f(*args, **kw)``'s result; its thread CPU, the least of ``repeats`` calls, added to
    ``out[key]`` (as the own draft's and DST's: this shared CPU's preemptions are not the
    work)."""
    spent = []
    for _ in range(repeats):
        c0 = time.thread_time()
        got = f(*args, **kw)
        spent.append(time.thread_time() - c0)
    out[key] = out.get(key, 0.0) + min(spent)
    return got


def _recorded(rounds, note):
    """``rounds`` (a rank's generator) passed through, ``note(parts, agreed)`` called with each
    round's parts and the group's answer (None: nothing noted)."""
    parts = next(rounds)
    while True:
        try:
            agreed = yield parts
            if note is not None:
                note(parts, agreed)
            parts = rounds.send(agreed)
        except StopIteration as done:
            return done.value


def _sizes(log: list):
    """A ``_recorded`` note that appends each round's parts' sizes to ``log``."""
    return lambda parts, agreed: log.append(
        {op: {k: int(np.asarray(v).size) for k, v in parts.get(op, {}).items()}
         for op in ("sum", "max", "cat")})


def span_rounds(span: np.ndarray) -> list:
    """The sizes (floats: ``{"sum": n, "max": n}``) of rank 0's parts, round by round, of the
    candidates' agreement from every rank's makespan ``span`` (``span_select``), every rank's
    rounds driven in lockstep; checked to agree ``slots.candidates``."""
    from sparsebalance_megatron.batching.slots import candidate_count, candidates
    from sparsebalance_megatron.batching.span_select import candidate_rounds
    from sparsebalance_megatron.policy.dst_rounds import plan_rounds_in_process

    dp, log = span.size, []
    gens = [_recorded(candidate_rounds(float(span[r]), r, dp, candidate_count()),
                      _sizes(log) if r == 0 else None)
            for r in range(dp)] if dp > 2 * candidate_count() else []
    if gens and not np.array_equal(plan_rounds_in_process(gens)[0], candidates(span)):
        raise SystemExit("the candidates' rounds disagree with slots.candidates")
    return [{op: sum(r[op].values()) for op in ("sum", "max")} for r in log]


def dst_all_ranks(costs, sens, settings, quality, rank_scale):
    """(every rank's ``RankPlan``, rank 0's rounds' sizes in floats): the package's rounds of
    every DP rank driven in lockstep (``plan_rounds_in_process``), as ``plan_dst_decomposed``
    drives them, with rank 0's parts logged."""
    from sparsebalance_megatron.policy.agreed_stats import straggler_present
    from sparsebalance_megatron.policy.dst_ranks import rank_slice
    from sparsebalance_megatron.policy.dst_rounds import plan_rounds_in_process, rank_rounds

    dp, log = costs.shape[0], []
    narrow = straggler_present(rank_scale, settings.tolerance)
    gens = [_recorded(rank_rounds(rank_slice(costs, r), None if sens is None else sens[r:r + 1],
                                  settings, quality=quality, narrow=narrow),
                      _sizes(log) if r == 0 else None) for r in range(dp)]
    return plan_rounds_in_process(gens), log


def rank_dst(costs, sens, settings, quality, rank_scale, repeats: int = 3) -> dict:
    """A rank's DST of one packing as this study prices it (``rank_step``, module docstring):
    every rank's rounds driven in lockstep ``repeats`` times (``dst_all_ranks``), each rank's
    thread CPU by ``dst_ranks.PHASES`` the least of the runs (``cpu`` [dp, phases]; a rank's
    DST: ``cpu.max(axis=0).sum()``, each phase's maximum over the ranks), each run's sum of the
    phases' maxima (``single``), the last run's plans and rank 0's rounds' sizes (``log``)."""
    cpu, single = None, []
    for _ in range(repeats):
        plans, log = dst_all_ranks(costs, sens, settings, quality, rank_scale)
        got = np.array([p.cpu_s for p in plans])                          # [dp, phases]
        cpu = got if cpu is None else np.minimum(cpu, got)
        single.append(float(got.max(axis=0).sum()))
    return {"cpu": cpu, "single": single, "plans": plans, "log": log}


def rank_step(drafter, raw, m: int, rank=None, repeats: int = 3) -> dict:
    """One step of ``raw`` (the step's segments) as DP rank ``rank`` plans it (module docstring;
    None: the critical rank): ``phases_s`` (thread CPU), ``draft_s`` (their sum), ``rank``,
    the sizes the bytes are priced from (``rounds``: each DST round's floats, both packings;
    ``row_floats``: the committed row; ``unit_floats``: a candidate rank's units), and for the
    rest of the study the whole plan's ``costs``, ``batch``, ``units`` and ``densities``."""
    from sparsebalance_megatron.batching.plan import checked_segments
    from sparsebalance_megatron.batching.sensitivity import unit_sensitivity
    from sparsebalance_megatron.megatron.step.choice import raise_headroom
    from sparsebalance_megatron.megatron.step.record import doc_slots
    from sparsebalance_megatron.policy.costs import UnitCosts, density_grid
    from sparsebalance_megatron.policy.dst_settings import dst_inputs
    from sparsebalance_megatron.policy.dst_ranks import PHASES

    sb, lm, dp = drafter.sb, drafter.latency, drafter.dp
    t: dict = {}
    gc.collect()
    gc.disable()
    try:
        segs = checked_segments(raw)
        whole_asg = drafter.assignment(segs, m)
        every = whole_asg.units()
        agreed = whole_asg.agree(every)
        whole = whole_asg.rank_plan(every, agreed)
        c = agreed.candidates
        r = rank if rank is not None else (int(c.ranks[np.argmax(c.span_s)]) if c is not None
                                           else 0)
        # the rank's own draft as the runtime makes it (``Drafter.own_draft``: SAB's assignment
        # and its units, its row of the baseline with its features), then settle's compute
        d = _timed(t, "own_draft", drafter.draft, 1, 0, segs, m, with_dst=False, rank=r,
                   repeats=repeats)
        asg, mine = d.sab
        own = _timed(t, "sab.rank_plan", asg.rank_plan, mine, agreed, repeats=repeats)
        _timed(t, "features", drafter.units, own, repeats=repeats)
        _timed(t, "sensitivity", unit_sensitivity, own, drafter.tracker, repeats=repeats)
        if own.micro_batches[0] != whole.micro_batches[r]:
            raise SystemExit(f"rank {r}: its own plan is not row {r} of the whole plan")
        base = drafter.pack(segs, m, sb.stand_down)                       # off the clock
        own_units = {0: drafter.units(own), 1: d.baseline[1]}
        own_rows = {0: own, 1: d.baseline[0]}
        # DST of both packings
        grid = density_grid(sb.density, sb.min_density, sb.max_density)
        h = raise_headroom(sb, lm, dp)
        dst = np.zeros(len(PHASES))
        rounds, sizes, single, totals = [], {}, [], []
        densities = None
        for i, batch in enumerate((whole, base)):
            units = drafter.units(batch)                                 # off the clock
            kept = batch.unit_csr()
            _timed(t, "unit_costs", UnitCosts.from_latency, lm, own_units[i], dp, m, grid,
                   kept_units=own_rows[i].unit_csr(), rank=r, rank_units=True,
                   repeats=repeats)
            costs = UnitCosts.from_latency(lm, units, dp, m, grid, kept_units=kept)
            sens = unit_sensitivity(batch, drafter.tracker)
            settings, quality = dst_inputs(sb, costs.shape[2], lm.p2p_s, h,
                                           drafter.attention_layers)
            # each rank's CPU per phase, the least of ``repeats`` lockstep runs (this shared
            # CPU's preemptions are not the rank's work), then each phase's max over the ranks
            got = rank_dst(costs, sens, settings, quality,
                           lm.correction_grid(dp, costs.pipeline_ranks), repeats)
            cpu, plans = got["cpu"], got["plans"]
            single += got["single"]
            dst += cpu.max(axis=0)
            totals.append(cpu.sum(axis=1))
            rounds += got["log"]
            if i == 0:
                idx = np.concatenate([p.grid_index for p in plans])
                densities = costs.densities[idx]
                sizes = dict(costs=costs, batch=batch, units=units, sens=sens)
        _timed(t, "busy_s", lm.busy_s, own_units[0], densities[r:r + 1],
               repeats=repeats)
    finally:
        gc.enable()
    for k, v in zip(PHASES, dst):
        t[f"dst.{k}"] = float(v)
    nv = densities.shape[2]
    row = nv * m + (0 if sizes["sens"] is None else sizes["sens"][r].size)
    per_rank = np.sum(totals, axis=0)            # both packings' DST of each rank, min of runs
    return {"rank": r, "phases_s": t, "draft_s": float(sum(t.values())), "rounds": rounds,
            "dst_rank_s": {"median": float(np.median(per_rank)),
                           "p99": float(np.percentile(per_rank, 99)),
                           "max": float(per_rank.max()),
                           "single_run_phase_maxima": single},
            "row_floats": int(row), "unit_floats": int(2 * m * nv + nv + 2 * m + 2),
            "report_floats": report_floats(drafter, own, own_units[0], densities[r:r + 1]),
            "candidates": 0 if c is None else int(c.ranks.size),
            "span_rounds": [] if c is None else span_rounds(every.span_s),
            "docs_max": int(max(len(s) for s in doc_slots(whole.micro_batches))),
            "costs": sizes["costs"], "batch": whole, "units": sizes["units"],
            "densities": densities, "own": own, "own_units": own_units[0]}


def report_floats(drafter, own, own_units, densities) -> dict:
    """Floats of the report's two all-reduced vectors (``{"sum": n, "max": n}``), from the
    rank's ``report_sums.rank_parts`` of its own row (fixed: stages, not DP or m)."""
    from sparsebalance_megatron.megatron.step.report_sums import rank_parts

    lm = drafter.latency
    parts = rank_parts(own, drafter.sb, densities, layers=lm.layout.layers,
                       attention_layers=lm.layout.attention_layers,
                       dense_below_tokens=lm.dense_below_tokens or 0, units=own_units, busy=0.0,
                       calibration=(0.0, 1.0))
    return {op: int(sum(np.size(v) for v in parts[op].values())) for op in ("sum", "max")}


def rank_after_step(lm, sb, own, own_units, densities, predicted, rank: int, tracker,
                    rng) -> float:
    """Thread CPU seconds of a rank's work after the step, as ``end_step`` does it on the
    per-rank path: its pipeline's calibration (a stand-in measurement, the prediction x 0.9-1.1),
    the tracker's update with its own documents, and the report's sums of its own units.
    ``densities`` [1, m, stages] and ``predicted`` [1, pp] (the committed plan's uncorrected
    busy seconds): the rank's own rows, as its settle commits them."""
    from sparsebalance_megatron.megatron.step.checks import doc_lengths
    from sparsebalance_megatron.megatron.step.record import doc_slots
    from sparsebalance_megatron.megatron.step.report_sums import (rank_parts, step_figures,
                                                                  summed_parts)

    predicted = np.asarray(predicted, dtype=np.float64).reshape(1, -1)
    noise = rng.uniform(0.9, 1.1, predicted.shape)
    ids = doc_slots(own)[0]
    signal = rng.uniform(1, 6, ids.size)
    routing = lm.dense_below_tokens or 0
    c0 = time.thread_time()
    lm.calibrate_ranks(predicted, predicted * noise, first=rank)
    tracker.update(ids, doc_lengths(own, ids), signal)
    layout = lm.layout                  # the group's sums stand in for this rank's own
    step_figures(summed_parts([rank_parts(
        own, sb, densities, layers=layout.layers,
        attention_layers=layout.attention_layers, dense_below_tokens=routing, units=own_units,
        busy=float((predicted[0] * noise[0]).sum()),
        calibration=(0.05, lm.correction(rank)))]), layers=layout.layers,
        attention_layers=layout.attention_layers)
    return time.thread_time() - c0

