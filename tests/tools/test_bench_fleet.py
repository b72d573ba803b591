"""The fleet bench's configs, figures and table alone (specserve bench fleet:
the suffix memory shared across requests and target replicas, or not), and
its one-line error for a bad flag."""

import argparse

import pytest

from specserve.config import AppConfig
from specserve.tools.bench import fleet


def test_the_two_systems_differ_only_in_sharing():
    shared, unshared = (AppConfig.from_dict(fleet.config("/m", s), source=s)
                        for s in fleet.SYSTEMS)
    assert shared.drafts[0].suffix.share and not unshared.drafts[0].suffix.share
    for cfg in (shared, unshared):
        assert cfg.target.replicas.min_replicas == cfg.target.replicas.max_replicas == 2
        assert cfg.routing.target == "serve"  # a family spreads over both replicas
        assert cfg.drafts[0].kind == "suffix" and cfg.drafts[0].name == fleet.POOL
    a, b = fleet.config("/m", "shared"), fleet.config("/m", "unshared")
    a["drafts"][0]["suffix"]["share"] = False
    assert a == b


def _snap(drafted, accepted, steps, with_drafts, targets):
    return {"draft_models": [{"model": fleet.POOL, "draft_tokens": drafted,
                              "accepted_tokens": accepted, "target_steps": steps,
                              "steps_with_drafts": with_drafts}],
            "targets": [{"replica": r, "requests": n} for r, n in targets.items()]}


def test_pool_figures_are_the_runs_difference():
    before = _snap(10, 5, 100, 10, {"t1": 2})
    after = _snap(110, 85, 300, 60, {"t1": 5, "t2": 3})
    f = fleet.pool_figures(before, after)
    assert (f["draft_tokens"], f["accepted_tokens"]) == (100, 80)
    assert f["acceptance_rate"] == 0.8 and f["coverage"] == 0.25
    assert f["mean_accepted_length"] == 1 + 80 / 50
    assert f["requests_per_replica"] == [3, 3]
    empty = fleet.pool_figures({}, {"draft_models": [], "targets": []})
    assert empty["acceptance_rate"] is None and empty["requests_per_replica"] == []


def test_the_table_puts_the_systems_side_by_side():
    row = dict(fleet.pool_figures(_snap(0, 0, 0, 0, {}), _snap(100, 60, 200, 40, {"a": 4})),
               output_tokens_per_s=12.5, wall_s=30.0, requests=8)
    other = dict(row, acceptance_rate=0.3, accepted_tokens=30)
    report = {"workload": {"members": 8, "rounds": 1, "max_tokens": 96},
              "systems": {"shared": row, "unshared": other}}
    text = fleet.markdown(report)
    assert "| shared | 0.600 (60 / 100) | 0.200 |" in text
    assert "| unshared | 0.300 (30 / 100) |" in text
    assert "shared / unshared acceptance: 2.00x" in text


def test_more_members_than_the_family_has_is_refused():
    with pytest.raises(ValueError, match="--members"):
        fleet.check(argparse.Namespace(members=fleet.MAX_MEMBERS + 1))
    from conftest import run_cli

    proc = run_cli("bench", "fleet", "--members", str(fleet.MAX_MEMBERS + 1), timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--members" in lines[0], proc.stderr
