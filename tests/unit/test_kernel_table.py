"""The kernel table's logic on CPU (``scripts/bench.py attention_gpu``, ``studies/kernels.py``):
the crossover, the target summary (the fastest backend against cuDNN, e per pass, the packed
micro-batches, the cost per call, the backward to keep, the simulator's price), the order of its
cases, its rows written as measured and cut at the deadline, and its own code path under the
Triton interpreter."""

import sys

import pytest

from tests.conftest import REPO, load_script as _script, load_study


def _row(backend, tokens, ours, dense=10.0, d=0.25, shape="8/2/128", case="single",
         routing="none", varlen=None, cudnn=None, select=None):
    row = dict(kind="call", case=case, shape=shape, tokens=tokens, backend=backend, density=d,
               routing=routing, ours_ms=ours, dense_ms=dense, ratio_vs_dense=ours / dense,
               dense_varlen_ms=varlen or dense, ratio_vs_varlen=ours / (varlen or dense),
               dense_cudnn_ms=cudnn or dense, ratio_vs_cudnn=ours / (cudnn or dense))
    if select is not None:
        row["select_ms"] = select
    return row


def _kernel(backend, variant, d, e_fwd, e_bwd, shape="8/2/128"):
    return dict(kind="kernel", case="single", shape=shape, tokens=32768, backend=backend,
                variant=variant, density=d, e_fwd=e_fwd, e_bwd=e_bwd)


def test_crossover_is_where_ours_stays_faster():
    kt = load_study("kernels")
    rows = [_row("triton", 4096, 12), _row("triton", 8192, 9), _row("triton", 16384, 11),
            _row("triton", 32768, 4), _row("triton", 65536, 3),
            _row("flex", 32768, 30), _row("triton", 32768, 1, d=0.5, shape="32/8/128")]
    # 8K was faster but 16K was not: the crossover is the shortest length from which every
    # longer measured length is faster too
    assert kt.crossover_of(rows, "triton", "8/2/128", 0.25) == 32768
    assert kt.crossover_of(rows, "flex", "8/2/128", 0.25) is None      # never: all dense
    assert kt.crossover_of(rows, "triton", "32/8/128", 0.5) == 32768
    assert kt.crossover_of(rows, "triton", "8/2/128", 0.125) is None   # not measured


def test_summary_checks_the_issue_targets():
    """Issue 61's targets per shape from the 32K document's call rows against cuDNN (the fastest
    backend), e from each backend's best variant per pass at its worst density, the packed
    micro-batches' worst call (routed rows where there are any), the fastest per density."""
    kt = load_study("kernels")
    rows = [_row("flex", 32768, 6.6), _row("triton", 32768, 2.9, select=0.25),
            dict(_row("triton", 32768, 6.0, d=0.5, select=0.35), select_gpu_ms=0.2,
                 select_host_ms=0.4),
            _row("triton", 32768, 12.0, d=1.0), _row("fa4", 32768, 2.8, shape="14/2/64"),
            _row("triton", 32768, 10.1, case="file#0", routing="crossover"),
            _row("triton", 32768, 10.5, case="file#0", routing="none"),   # routed rows judged
            _row("fa4", 32768, 9.0, case="file#0", routing="crossover"),
            dict(_row("flex", 32768, 1.0), failed="boom"),                 # failed: not judged
            _kernel("triton", "pinned", 0.25, 0.95, 0.5),
            _kernel("triton", "split", 0.25, 0.9, 0.92),
            _kernel("triton", "pinned", 1.0, 0.91, 0.6),
            _kernel("triton", "split", 1.0, 0.9, 0.95),
            _kernel("fa4", "fa4", 0.25, 0.95, 0.85)]
    s = kt.summarize(rows)
    big = s["shapes"]["8/2/128"]
    assert big["32k_d0.25"] == {"ratio_vs_cudnn": pytest.approx(0.29), "backend": "triton",
                                "target": 0.3, "met": True}
    assert big["32k_d0.5"]["ratio_vs_cudnn"] == pytest.approx(0.6) and not big["32k_d0.5"]["met"]
    # triton: forward 0.91 at worst (d 1.0, its best variant's), backward 0.92 (d 0.25's split)
    assert big["e"]["triton"] == {"fwd": 0.91, "bwd": 0.92, "met": True}
    assert big["e"]["fa4"]["met"] is False
    assert big["select_ms"] == {"triton": 0.35}                # the upper median of two
    assert big["select_gpu_ms"] == {"triton": 0.2} and big["select_host_ms"] == {"triton": 0.4}
    assert big["packed_worst_vs_dense"] == {"triton": pytest.approx(1.01), "fa4": 0.9}
    assert big["fastest"] == {"0.25": "triton", "0.5": "triton", "1.0": "dense"}
    assert s["shapes"]["14/2/64"]["32k_d0.25"]["backend"] == "fa4"
    assert s["targets"] == {"32k_d0.25<=0.3x_cudnn": True, "32k_d0.5<=0.58x_cudnn": False,
                            "e>=0.9_fwd_and_bwd": True, "select<=0.3ms": False,
                            "packed<=1.02x_dense": True}


def test_the_summary_names_the_backward_that_is_faster_at_every_density():
    """``backward_choice``: fa4's two backward forms (``BWD_PER_HEAD``) on the 32K document; the
    per-head form wins at every density here, so the summary names it; where each form wins
    somewhere, none; a backend timed in one form is not listed."""
    kt = load_study("kernels")

    def k(variant, d, bwd, backend="fa4"):
        return dict(kind="kernel", case="single", shape="8/2/128", tokens=32768, backend=backend,
                    variant=variant, density=d, e_fwd=1.0, e_bwd=1.0, bwd_ms=bwd, fwd_ms=1.0,
                    kept_fraction=d)

    rows = [k("fa4", d, 1.5 + 8 * d) for d in (0.25, 0.5, 1.0)]
    rows += [k("bwd per head", d, 0.4 + 8.2 * d) for d in (0.25, 0.5, 1.0)]
    rows += [k("pinned", 0.25, 3.0, backend="triton")]
    got = kt.summarize(rows)["shapes"]["8/2/128"]["backward"]
    assert list(got) == ["fa4"] and got["fa4"]["fastest_everywhere"] == "bwd per head"
    assert got["fa4"]["bwd_ms"]["fa4"][0.5] == pytest.approx(5.5)
    rows[-2]["bwd_ms"] = 20.0                       # per head loses at d 1: no form wins everywhere
    assert kt.summarize(rows)["shapes"]["8/2/128"]["backward"]["fa4"]["fastest_everywhere"] \
        is None


def test_the_summary_prices_each_call_for_the_simulator_where_two_lengths_were_timed():
    """``call_prices``: fa4 timed on one document at 16K and 32K (the kernel-fa4 call) gets the
    simulator's price (``sparse_call.fit_price``); triton at two densities gets none; other
    shapes do not count, nor packed micro-batches whose kept tiles no kernel row counts."""
    from sparsebalance_megatron.latency.work import attention_work
    kt = load_study("kernels")

    def ms(t, d):          # 0.9 ms a call + 0.02 ms per 1K tokens + 0.2 us per kept tile
        return 0.9 + 0.02 * t / 1024 + 0.2e-3 * attention_work([t], d, 128, 1)

    rows = [_row("fa4", t, ms(t, d), d=d) for t in (16384, 32768) for d in (0.25, 0.5, 1.0)]
    rows += [_row("triton", 32768, 5.0, d=d) for d in (0.25, 0.5)]
    rows += [_row("fa4", 16384, 99.0, shape="14/2/64"), _row("fa4", 32768, 99.0, case="file#0")]
    got = kt.summarize(rows)["prices"]
    assert list(got) == ["fa4"]
    # (issue 74: the price also says the lengths it was fitted at and each pass's share, the
    # 2 : 1 and 2.5 : 1 defaults where the rows did not time the passes apart)
    assert {k: got["fa4"][k] for k in ("call_ms", "per_32k_tokens_ms", "tile_us")} == {
        "call_ms": pytest.approx(0.9), "per_32k_tokens_ms": pytest.approx(0.64),
        "tile_us": pytest.approx(0.2)}
    assert got["fa4"]["lengths"] == [16384, 32768]
    assert got["fa4"]["call_bwd_share"] == pytest.approx(2 / 3)


def test_the_price_is_fitted_pass_by_pass_on_every_micro_batch_the_table_timed():
    """One length is priced at that length (its per-token part in the call's cost); the passes
    timed apart give the price its shares; a packed micro-batch counts with the kept tiles its
    kernel rows counted (``tiles`` over the query heads); ``fixed_ms`` per micro-batch is the
    same fit's call term (no line of its own)."""
    kt = load_study("kernels")

    def passes(kept):            # fwd 0.3 ms + 0.1 us a tile, bwd 1.2 ms + 0.25 us a tile
        return 0.3 + 0.1e-3 * kept, 1.2 + 0.25e-3 * kept

    rows = []
    for case, kept in (("single", {0.25: 8323, 0.5: 16513, 1.0: 32896}),
                       ("file#0", {0.25: 2446, 0.5: 4680, 1.0: 9169})):
        for d, k in kept.items():
            f, b = passes(k)
            rows.append(dict(_row("fa4", 32768, f + b, d=d, case=case), call_fwd_ms=f,
                             call_bwd_ms=b))
            rows.append(dict(_kernel("fa4", "fa4", d, 0.9, 0.9), case=case, tiles=8 * k,
                             fwd_ms=f - 0.1, bwd_ms=b))
    s = kt.summarize(rows)
    got = s["prices"]["fa4"]
    assert got["call_ms"] == pytest.approx(1.5) and got["tile_us"] == pytest.approx(0.35)
    assert got["per_32k_tokens_ms"] == 0.0 and got["lengths"] == [32768]
    assert got["call_bwd_share"] == pytest.approx(0.8)
    assert got["tile_bwd_share"] == pytest.approx(0.25 / 0.35)
    assert s["shapes"]["8/2/128"]["fixed_ms"] == {
        "fa4 fa4 file#0 32768": {"fwd": pytest.approx(0.2), "bwd": pytest.approx(1.2)},
        "fa4 fa4 single 32768": {"fwd": pytest.approx(0.2), "bwd": pytest.approx(1.2)}}


def test_shape_argument_is_checked():
    kt = load_study("attention_gpu")
    assert kt.parse_shape("14/2/64") == (14, 2, 64)
    for bad in ("14/3/64", "14-2-64", "0/1/64"):
        with pytest.raises(ValueError, match=bad):
            kt.parse_shape(bad)


# --- the bench's order, rows as they come, deadline (studies/attention_gpu.py) --------------

def _args(kt, **kw):
    import argparse
    a = dict(densities=list(kt.DENSITIES), shapes=list(kt.SHAPES),
             lengths=list(kt.SINGLE_LENGTHS), cases=["single", "file"], reps=1, check=True)
    a.update(kw)
    return argparse.Namespace(**a)


def test_bench_runs_the_cases_that_decide_the_targets_first():
    kt = load_study("attention_gpu")
    mixes = {"file": [[30000, 2768], [32768]], "section": [[16384] * 2, [8192] * 4]}
    jobs = kt.plan_cases(_args(kt), mixes)
    # the default grid: one 32K document at each shape, then one packed micro-batch of files
    assert [(j["case"], sum(j["lens"]), j["shape"]) for j in jobs] == [
        ("single", 32768, "8/2/128"), ("single", 32768, "14/2/64"),
        ("file#0", 32768, "8/2/128"), ("file#0", 32768, "14/2/64")]
    assert kt.DENSITIES[:2] == (0.25, 0.5)          # the target densities first
    jobs = kt.plan_cases(_args(kt, lengths=[8192, 32768], cases=["single", "section"]), mixes)
    assert [(j["case"], j["lens"][0], j["shape"]) for j in jobs][:3] == [
        ("single", 32768, "8/2/128"), ("single", 8192, "8/2/128"), ("single", 32768, "14/2/64")]
    assert sum(j["packed"] for j in jobs) == 2 and jobs[-1]["case"] == "section#0"


class _FakeTime:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_rows_are_written_as_measured_and_the_deadline_stops_new_rows(tmp_path, monkeypatch):
    """Each row is on disk the moment it is measured (a call cut at its limit keeps them);
    backend by backend, kernel rows (every variant) before the call row at each density; no row
    starts once the deadline is nearer than 1.5x the longest row so far."""
    import json
    kt = load_study("attention_gpu")
    now = _FakeTime()
    jsonl = tmp_path / "rows.jsonl"
    on_disk = []

    class FakeCase:
        def __init__(self, name, lens, shape, seed=0):
            self.name, self.doc_lens, self.shape = name, lens, shape
            self.tokens, self.hn, self.g = sum(lens), 128, None
            self.q = self.k = self.v = None

    class FakeLists:
        def __init__(self, case, d):
            self.tiles, self.kept_fraction = 100, d

    def dense(case, reps):
        now.t += 2
        return {"cudnn": {"fwd_ms": 2.0, "bwd_ms": 6.0}, "sdpa": {"fwd_ms": 3.0, "bwd_ms": 7.0},
                "varlen": {"failed": "no"}}

    def timed(fn, inputs, g, reps):
        on_disk.append(len(jsonl.read_text().splitlines()))   # rows before this one
        now.t += 10
        split = {f"{p}_{k}": v for p in ("fwd", "bwd")
                 for k, v in (("host_ms", 0.25), ("gpu_ms", 0.75), ("held", 0))}
        return {"fwd_ms": 1.0, "bwd_ms": 3.0, "bwd_method": "retained graph", **split}
    monkeypatch.setattr(kt, "Case", FakeCase)
    monkeypatch.setattr(kt, "Lists", FakeLists)
    monkeypatch.setattr(kt, "dense_passes", dense)
    monkeypatch.setattr(kt, "pass_times", timed)
    monkeypatch.setattr(kt, "kernel_fn", lambda *a: None)
    monkeypatch.setattr(kt, "call_fn", lambda *a: None)
    monkeypatch.setattr(kt, "variants", lambda b, case: [("pinned", None), ("split", None)]
                        if b == "triton" else [(b, None)])
    monkeypatch.setattr(kt.torch._dynamo, "reset", lambda: None)
    log = kt.RowLog(str(jsonl))
    clock = kt.Clock(deadline_s=60, now=now)
    # dense 2 s, then rows of 10 s: a row starts while at least max(15, 1.5 x 10) s are left,
    # at 2, 12, 22, 32 and 42 s; at 52 s (8 s left) none does
    args = _args(kt, shapes=["8/2/128"], densities=[0.25, 0.5], cases=["single"], check=False)
    assert not kt.run(args, ["triton", "flex"], log, clock, {})
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert rows == log.rows and on_disk == [1, 2, 3, 4, 5]
    assert [(r["kind"], r.get("variant"), r.get("density")) for r in rows] == [
        ("dense", None, None), ("kernel", "pinned", 0.25), ("kernel", "split", 0.25),
        ("call", None, 0.25), ("kernel", "pinned", 0.5), ("kernel", "split", 0.5)]
    assert rows[0]["dense_ms"] == 8.0 and rows[0]["dense_varlen_ms"] is None
    k, c = rows[1], rows[3]
    assert k["e_fwd"] == pytest.approx(0.25 * 2.0 / 1.0) and k["e_bwd"] == pytest.approx(0.5)
    assert rows[4]["e_fwd"] == pytest.approx(0.5 * 2.0) and "failed" not in rows[4]  # 2nd d
    assert k["ratio_vs_cudnn"] == pytest.approx(0.5)
    # the call's forward less the first (pinned) kernel's: selection and lists
    assert c["ours_ms"] == 4.0 and c["select_ms"] == 0.0 and c["ratio_vs_cudnn"] == 0.5
    assert "ratio_vs_varlen" not in c
    # each pass's host and GPU-alone times, kept on kernel rows and (prefixed) on call rows
    assert k["bwd_host_ms"] == 0.25 and k["fwd_gpu_ms"] == 0.75 and k["bwd_held"] == 0
    assert c["call_fwd_host_ms"] == 0.25 and c["call_bwd_gpu_ms"] == 0.75
    assert c["select_gpu_ms"] == 0.0 and c["select_host_ms"] == 0.0


def check_kernel_table_runs_on_cpu():
    """The kernel table's own code path, on CPU tensors under the interpreter (float16; cuDNN
    absent): checks, kernel rows of the pinned and a split backward, call rows."""
    import argparse
    import functools

    import torch
    kt = load_study("attention_gpu")
    kt.Case = functools.partial(kt.Case, device="cpu", dtype=torch.float16)
    kt.CHECK_LENS = (130, 1, 60, 65)
    variants = kt.variants
    kt.variants = lambda b, case: variants(b, case)[:2]          # pinned, one split
    args = argparse.Namespace(shapes=["2/1/32"], densities=[0.5], cases=["single"],
                              lengths=[256], reps=1, check=True)
    log = kt.RowLog(None)
    assert kt.run(args, ["triton"], log, kt.Clock(None), {})
    kinds = [(r["kind"], r.get("variant")) for r in log.rows]
    assert kinds[:2] == [("check", "pinned"), ("check", kinds[1][1])]
    assert kinds[1][1].startswith("split dq") and all(r["ok"] for r in log.rows[:2])
    assert kinds[2:] == [("dense", None), ("kernel", "pinned"), ("kernel", kinds[1][1]),
                         ("call", None)]
    dense, kern, call = log.rows[2], log.rows[3], log.rows[5]
    assert "failed" in dense["cudnn"] and dense["dense_ms"] > 0    # no cuDNN on a CPU
    assert kern["tiles"] > 0 and 0 < kern["kept_fraction"] <= 1
    assert kern["fwd_ms"] > 0 and kern["bwd_ms"] > 0 and kern["bwd_method"] == "retained graph"
    assert "fwd_host_ms" not in kern and "select_gpu_ms" not in call  # no GPU: no split
    assert call["ours_ms"] == call["call_fwd_ms"] + call["call_bwd_ms"] and "select_ms" in call


def check_the_correctness_check_fails_a_wrong_kernel():
    import torch
    sys.path.insert(0, str(REPO / "scripts"))
    from studies.kernels import Case, Lists, check, kernel_fn
    case = Case("check", (130, 1, 60, 65), "2/1/32", device="cpu", dtype=torch.float16)
    lists = Lists(case, 0.3)
    right = kernel_fn("triton", lists, case)
    assert check(right, case, lists)["ok"]
    case.scale *= 1.05                                           # the kernel's scale only
    wrong = kernel_fn("triton", lists, case)
    case.scale /= 1.05
    got = check(wrong, case, lists)
    assert not got["ok"] and got["out"]["rel_err"] > got["out"]["bar"]
    flaky = iter([1.0, 1.0 + 2 ** -7])                           # two calls that differ
    got = check(lambda q, k, v: right(q, k, v) * next(flaky), case, lists, repeats=2)
    assert not got["ok"] and not got["identical_out"] and got["finite"]
    # gradients that differ within the bar from call to call (atomic sums' order) pass; NaN not
    calls = iter(range(3))

    def noisy(q, k, v):
        out = right(q, k, v)
        n = next(calls)
        return out + (out.detach() * 0 if n == 0 else (out - out.detach()) * 2 ** -11)
    got = check(noisy, case, lists, repeats=3)
    assert got["ok"] and 0 < got["dq"]["repeat_rel_diff"] <= got["dq"]["bar"]
    got = check(lambda q, k, v: right(q, k, v) * float("nan"), case, lists)
    assert not got["ok"] and not got["finite"]


def test_kernel_table_runs_on_cpu(interp):
    interp("check_kernel_table_runs_on_cpu")


def test_the_correctness_check_fails_a_wrong_kernel(interp):
    interp("check_the_correctness_check_fails_a_wrong_kernel")


def test_the_summary_names_each_kernels_fixed_cost_per_call():
    """``fixed_costs``: each kernel's price on one micro-batch (``sparse_call.fit_price``, the
    simulator's fit; issue 74: one body, no line of its own) crosses zero kept tiles at its cost
    per call, every density in; below three rows, none."""
    kn = load_study("kernels")
    rows = [dict(kind="kernel", shape="8/2/128", backend="fa4", variant="fa4", case="single",
                 tokens=32768, density=d, tiles=8 * k, fwd_ms=0.3 + 0.1e-3 * k,
                 bwd_ms=1.4 + 0.25e-3 * k)
            for d, k in ((0.125, 4231), (0.25, 8323), (0.5, 16513), (1.0, 32896))]
    got = kn.fixed_costs(rows, "8/2/128")
    assert list(got) == ["fa4 fa4 single 32768"]
    assert got["fa4 fa4 single 32768"] == {"fwd": pytest.approx(0.3), "bwd": pytest.approx(1.4)}
    assert kn.fixed_costs(rows[:2], "8/2/128") == {}           # two rows only


def test_gpu_check_reads_the_rows_of_a_cut_run(tmp_path):
    import json
    gc = _script("gpu_check")
    p = tmp_path / "rows.jsonl"
    p.write_text(json.dumps(_row("triton", 32768, 3)) + "\n" + '{"case": "sing')
    assert [r["ours_ms"] for r in gc.rows_of(str(p))] == [3]
    assert gc.rows_of(str(tmp_path / "none.jsonl")) == []


@pytest.mark.parametrize("script, argv, needle", [
    ("attention_gpu", ["--lengths", "32768", "64"], "--lengths 64: expected token counts"),
    ("gpu_check", ["--bench-lengths", "0"], "--bench-lengths 0: expected token counts >= 128")])
def test_a_length_under_one_block_is_named_before_any_work(script, argv, needle, capsys, tmp_path):
    with pytest.raises(SystemExit):
        main = _script(script).main if script == "gpu_check" else load_study(script).main
        main([*argv, *(["--out-dir", str(tmp_path / "o")] if script == "gpu_check" else [])])
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
