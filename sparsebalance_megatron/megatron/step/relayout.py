"""A resume on another layout: what of the balancer's saved state still applies.

A checkpoint's plugin state (``step/state.py``) records the layout it was saved on
(``layout_record``: DP, PP, virtual stages per pipeline rank, micro-batches per step). Megatron
resumes its weights on another layout (torch_dist reshards them); the balancer's state is then
kept where it still means what it meant, dropped where it does not, and one line says which
(``relayout``):

- the sensitivities (per document) and the stand-down counts (per run) do not depend on the
  layout: kept;
- the latency calibration corrects the predictions of a (DP rank, pipeline rank)'s work. With the
  same pipeline (PP and virtual stages) a DP rank that still exists runs the same stages over
  the same kind of micro-batches: its factor and its pipeline ranks' factors are kept (they are
  ratios, so another micro-batch count or global batch leaves them right), those of the DP ranks
  gone are dropped, a new DP rank starts at 1. The recent errors (DST's raise headroom) stay.
- with another pipeline (PP or virtual stages changed) every stage holds other layers and every
  prediction is of another kind: the whole calibration is dropped (factors and errors), and
  calibration learns it again from the first step.

A state of a version that did not record its layout is read as saved on the DP size its
calibration names (its highest DP rank + 1) and on this run's pipeline. No torch, no megatron.
"""

from __future__ import annotations

from typing import Optional

LAYOUT_KEYS = ("dp", "pp", "vp", "microbatches")


def layout_record(dp: int, pp: int, vp: int, microbatches: Optional[int]) -> dict:
    """What a state records of the layout it was saved on."""
    return {"dp": int(dp), "pp": int(pp), "vp": int(vp),
            "microbatches": None if microbatches is None else int(microbatches)}


def describe(layout: dict) -> str:
    parts = [f"DP {layout['dp']}", f"PP {layout['pp']}"]
    if layout.get("vp", 1) > 1:
        parts.append(f"{layout['vp']} virtual stages per pipeline rank")
    text = " x ".join(parts[:2]) + "".join(f", {p}" for p in parts[2:])
    if layout.get("microbatches") is not None:
        text += f", {layout['microbatches']} micro-batches per step"
    return text


def saved_layout(state: dict, now: dict) -> dict:
    """The layout ``state`` was saved on: its record, or for a state without one the DP size its
    calibration names and this run's pipeline."""
    rec = state.get("layout")
    if rec:
        return {k: rec.get(k) for k in LAYOUT_KEYS}
    ranks = [int(r) for r in ((state.get("latency") or {}).get("corrections") or {})]
    return dict(now, dp=max(ranks) + 1 if ranks else now["dp"], microbatches=None)


def _adapt_latency(latency: Optional[dict], dp: int, same_pipeline: bool):
    """(the calibration state kept, [what was dropped])."""
    if not latency:
        return latency, []
    if not same_pipeline:
        n_f = len(latency.get("corrections") or {})
        n_s = len(latency.get("stage_corrections") or {})
        n_e = len(latency.get("errors") or [])
        return ({"corrections": {}, "errors": []},
                [f"the whole latency calibration ({n_f} DP rank factor(s), {n_s} stage "
                 f"factor(s), {n_e} recent error(s): another pipeline)"] if n_f + n_s + n_e
                else [])
    corr = {r: f for r, f in (latency.get("corrections") or {}).items() if int(r) < dp}
    stages = {k: f for k, f in (latency.get("stage_corrections") or {}).items()
              if int(str(k).split(",")[0]) < dp}
    gone = sorted({int(r) for r in latency.get("corrections") or {}} - {int(r) for r in corr})
    out = dict(latency, corrections=corr)
    if "stage_corrections" in latency:
        out["stage_corrections"] = stages
    dropped = []
    if gone:
        n_s = len(latency.get("stage_corrections") or {}) - len(stages)
        dropped.append(f"the calibration of DP rank(s) {', '.join(map(str, gone))} (gone: "
                       f"{len(gone)} factor(s), {n_s} stage factor(s))")
    return out, dropped


def relayout(state: dict, now: dict, *, latency: bool = True, sensitivity: bool = True
             ) -> tuple[dict, Optional[str]]:
    """(``state`` for a run on the layout ``now`` (``layout_record``), the line that says what
    was kept and dropped; None where the layout is the saved one). ``latency`` /
    ``sensitivity``: whether this run has them (only those are named)."""
    saved = saved_layout(state, now)
    if all(saved.get(k) == now.get(k) for k in LAYOUT_KEYS
           if saved.get(k) is not None and now.get(k) is not None):
        return state, None
    same_pipeline = (saved["pp"], saved.get("vp") or 1) == (now["pp"], now.get("vp") or 1)
    out = dict(state)
    out["latency"], dropped = _adapt_latency(state.get("latency"), now["dp"], same_pipeline)
    basis = state.get("ahead_basis")
    if basis:
        out["ahead_basis"] = dict(basis, latency=_adapt_latency(basis.get("latency"), now["dp"],
                                                                same_pipeline)[0])
    kept = []
    if sensitivity and state.get("sensitivity") is not None:
        kept.append("the sensitivities")
    if state.get("stand_down") is not None:
        kept.append("the stand-down counts")
    if state.get("eval_profile"):              # per decoder layer: any layout's
        kept.append("the evaluation's trained profile")
    if latency and same_pipeline and state.get("latency"):
        ranks = sorted(int(r) for r in out["latency"].get("corrections") or {})
        kept.append(f"the calibration of DP rank(s) {', '.join(map(str, ranks))} and its "
                    f"recent errors" if ranks else "the calibration's recent errors")
    if not latency:
        dropped = []
    kept = " and ".join(filter(None, [", ".join(kept[:-1]), kept[-1] if kept else ""]))
    what = (f"keeps {kept or 'nothing'}; "
            f"{'drops ' + '; '.join(dropped) if dropped else 'drops nothing'}")
    return out, (f"resuming on another layout (saved on {describe(saved)}; now {describe(now)}): "
                 f"the balancer {what}")
