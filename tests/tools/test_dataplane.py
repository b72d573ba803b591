"""`specserve bench dataplane`: its pure parts alone, then one tiny real run.

The real run (rows 8 and 64, short cells, a small capacity cell) starts the
real proposer and sink, a draft process and the emulated engine loop, and
checks the JSON's documented keys and that every figure was measured: no
timing thresholds (the machine is shared; the figures are the bench's to report).
"""

import json

import pytest

from conftest import run_cli
from specserve.tools.bench import dataplane_draft
from specserve.tools.bench import dataplane_workload as w

# ---- pure -------------------------------------------------------------------------


def test_true_tokens_are_one_function_of_seed_and_position():
    vec = w.true_tokens(7, 1000, 1100, 32000).tolist()
    assert vec == [w.true_token(7, p, 32000) for p in range(1000, 1100)]
    assert w.true_tokens(7, 0, 50, 32000).tolist() != w.true_tokens(8, 0, 50, 32000).tolist()
    assert all(0 <= t < 100 for t in w.true_tokens(3, 0, 500, 100).tolist())
    with pytest.raises(ValueError):
        w.true_tokens(1, 5, 4, 10)


def test_accepted_is_the_leading_matches():
    assert w.accepted([1, 2, 3], [1, 2, 3, 4]) == 3
    assert w.accepted([1, 9, 3], [1, 2, 3, 4]) == 1
    assert w.accepted([], [1]) == 0
    assert w.accepted([5, 6], [5]) == 1  # the truth ends (the context's end)


def test_plan_defaults_and_refusals():
    plan = w.make_plan()
    assert plan.cells == tuple((r, c) for r in w.ROWS for c in w.CONTEXTS)
    assert (plan.k, plan.draft.lookahead, plan.draft.fan_out, plan.draft.branch_budget) == \
        (4, 9, 3, 15)
    assert plan.draft.draft_step_ms == 4.0  # one token per request per draft step at 250/s
    assert w.make_plan(rate=0).draft.unlimited
    for kwargs, needle in [({"alpha": 1.5}, "--alpha"), ({"lookahead": 4}, "--lookahead"),
                           ({"gil_ms": 30.0}, "--gil-ms"),
                           ({"cells": [(8, 1)]}, "no prompt")]:
        with pytest.raises(ValueError, match=needle):
            w.make_plan(**kwargs)
    assert w.plan_output(plan, 1024) == 256 and w.plan_output(plan, 300) == 150


def test_cell_figures_and_table():
    f = w.cell_figures(
        256, 8192, 4, propose_s=[0.001, 0.002, 0.003], waits_s=[0.0, 0.0, 0.0025],
        steps_s=[0.022, 0.022],
        baseline_steps_s=[0.02, 0.02], round_trips_s=[0.004, 0.006], missed_round_trips=1,
        sink_delta={"draft_tokens_buffered": 900, "rows_seen": 10, "rows_with_proposals": 5},
        seconds=2.0, drafts_delta={"drafted_tokens": 1000, "wire_tokens": 5000, "cpu_s": 1.0},
        drafts_seconds=2.0, rss_mb=64.0, gained=30, verify_steps=10, cpu_s=1.5,
        legs=([0.001, 0.003], [0.003, 0.003]))
    assert f["propose_p50_ms"] == 2.0 and f["loop_slowdown"] == 1.1
    # the work without the bounded wait: 1, 2 and 0.5 ms; one step waited
    assert f["propose_work_p50_ms"] == 1.0 and f["steps_waited"] == 1
    assert f["wait_p99_ms"] == 2.5
    assert f["offered_tokens_per_s"] == 500.0 and f["ingest_tokens_per_s"] == 450.0
    assert f["round_trip_p50_ms"] == 5.0 and f["round_trips_unanswered"] == 1
    assert f["draft_sender_tokens_per_s"] == 2500.0 and f["rss_mb_per_1k_requests"] == 250.0
    assert f["coverage"] == 0.5 and f["tokens_per_step"] == 3.0
    assert f["to_draft_p50_ms"] == 2.0 and f["from_draft_p50_ms"] == 3.0
    assert f["target_process_cpu_cores"] == 0.75 and f["draft_processes_cpu_cores"] == 0.5
    table = w.markdown({"ingest_capacity_tokens_per_s": 1e5, "cells": [f]})
    assert table.count("\n| 256 | 8,192 |") == 1 and "ingest capacity: 100,000" in table
    assert w.minus({"a": 5, "b": "x"}, {"a": 2}) == {"a": 3}


class _Link:
    def __init__(self):
        self.sent = []

    def send_draft(self, rid, position, tokens, branches=()):
        self.sent.append((position, list(tokens), list(branches)))


def _replica(alpha: float, fan_out: int = 3):
    """A DraftReplica on a recording link (no stream, no process)."""
    r = dataplane_draft.DraftReplica.__new__(dataplane_draft.DraftReplica)
    r.plan = w.make_plan(alpha=alpha, fan_out=fan_out).draft
    r.requests, r._split, r.link, r.heard = {}, {}, _Link(), {}
    r.counts = {"drafted_tokens": 0, "wire_tokens": 0, "messages": 0, "rollbacks": 0,
                "branches_taken": 0, "requests": 0}
    return r


def test_the_emulated_draft_follows_the_target():
    d = _replica(alpha=1.0)
    req = d.requests["r"] = dataplane_draft._Request("r", 11, 100, 1000, 4)
    req.budget = 5
    d._draft(req, answer=False)
    truth = w.true_tokens(11, 0, 1000, 32000).tolist()
    assert d.link.sent[-1][:2] == (100, truth[100:105])  # A = 1: the truth itself
    assert d.link.sent[-1][2]  # with branches
    d._on_verified("r", 100, truth[100:103])  # three accepted
    assert req.v == 103 and req.win == truth[103:105]
    assert d.link.sent[-1][0] == 103  # it answers at once, from the new verified position
    assert set(d.heard) == {("r", 103)}  # when the update came (the round trip's legs)


def test_the_emulated_draft_rolls_back_on_a_rejection():
    d = _replica(alpha=0.0, fan_out=0)  # every drafted token wrong
    req = d.requests["r"] = dataplane_draft._Request("r", 5, 50, 1000, 4)
    req.budget = 3
    d._draft(req, answer=False)
    truth = w.true_tokens(5, 0, 1000, 32000).tolist()
    assert req.win != truth[50:53]
    d._on_verified("r", 50, truth[50:51])  # the target rejected our first token
    assert req.v == 51 and req.win == [] and d.counts["rollbacks"] == 1
    d._on_verified("r", 60, truth[60:61])  # a gap: ignored until filled
    assert req.v == 51


# ---- one tiny real run --------------------------------------------------------------


@pytest.mark.slow
def test_a_tiny_run(tmp_path):
    out = tmp_path / "dp.json"
    proc = run_cli("bench", "dataplane", "--rows", "8", "64", "--context", "512",
                   "--duration", "1.5", "--warmup", "0.3", "--baseline", "0.5",
                   "--capacity-rows", "8", "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ingest_capacity_tokens_per_s"] > 0
    assert [(c["rows"], c["context"], c["k"]) for c in report["cells"]] == [(8, 512, 4),
                                                                             (64, 512, 4)]
    for c in report["cells"]:
        for key in ("propose_p50_ms", "propose_p99_ms", "loop_slowdown", "offered_tokens_per_s",
                    "ingest_tokens_per_s", "round_trip_p50_ms", "round_trip_p99_ms",
                    "draft_sender_tokens_per_s", "rss_mb_per_1k_requests"):
            # (round trips: None when none was answered, an overrun cell)
            assert isinstance(c[key], (int, float)) or (c[key] is None and "round" in key), \
                (key, c)
        assert 0 < c["propose_p50_ms"] <= c["propose_p99_ms"]
        assert c["offered_tokens_per_s"] > 0 and c["loop_slowdown"] > 0.5 and c["steps"] > 0
    # 8 rows are light enough to be measured on any machine; 64 can already
    # overrun a loaded one (then its round trips go unanswered, and say so)
    small = report["cells"][0]
    assert small["round_trips"] > 0 and small["round_trip_p50_ms"] > 0
    assert small["ingest_tokens_per_s"] > 0
    assert "| 64 | 512 |" in proc.stdout and "ingest capacity" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_bad_flags_are_one_line_errors():
    for args, needle in [(["--rows", "0"], "rows must be >= 1"), (["--alpha", "2"], "--alpha"),
                         (["--gil-ms", "30"], "--gil-ms")]:
        proc = run_cli("bench", "dataplane", *args)
        assert proc.returncode == 2 and proc.stdout == ""
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_the_plan_from_flags():
    from specserve.cli import build_parser

    args = build_parser().parse_args(["bench", "dataplane", "--quick"])
    assert w.plan_from_args(args).cells == w.QUICK_CELLS
    args = build_parser().parse_args(["bench", "dataplane", "--rows", "8", "--context", "512",
                                      "1024", "--rate", "0"])
    plan = w.plan_from_args(args)
    assert plan.cells == ((8, 512), (8, 1024)) and plan.draft.unlimited
    assert build_parser().parse_args(["bench", "--quick"]).bench_command is None


def test_the_engine_loop_prefills_new_requests_then_decodes():
    from specserve.tools.bench.dataplane_loop import HELD, EngineLoop

    plan = w.make_plan(cells=[(2, 64)], output_tokens=16, prefill_tokens_per_step=16)
    loop = EngineLoop(2, 64, plan, gil_work=1)
    loop.start_all()
    assert list(loop.prefill_left) == [HELD, HELD] and loop.sampled == [[], []]
    loop.activate_all()
    n = [int(x) for x in loop.num_tokens]
    assert all(49 <= x <= 64 for x in n)
    assert loop.sampled == [[int(loop.truth[i, n[i] - 1])] for i in range(2)]
    first = loop.rids[0]
    for _ in range(64 - n[0]):  # no drafts: one token a step, up to the context's end
        loop._verify(None)
    assert loop.rids[0] != first and loop.num_tokens[0] == 48  # a new request, its prompt
    assert loop.prefill_left[0] == 3 and loop.sampled[0] == []  # 48 tokens at 16 a step
    assert loop.token_ids[0, :48].tolist() == loop.truth[0, :48].tolist()
    for _ in range(3):
        loop._verify(None)
    assert loop.num_tokens[0] == 49 and loop.sampled[0] == [int(loop.truth[0, 48])]
    assert loop.batch.req_ids[0].startswith(loop.rids[0] + "-") and \
        len(loop.batch.req_ids[0]) == len(loop.rids[0]) + 9  # vLLM's row id: id + 8 hex
