"""`make gpu-check` cannot rot: its CPU-sized form runs here end to end (slow), and
its preflight refuses a machine without a GPU, with the fix in the message.
The measurement arithmetic (step cost from two runs, the profile) is checked by hand."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from specserve.tools.gpucheck import PreflightError, main, preflight
from specserve.tools.measure import Cell, _step_point, profile_from_points
from specserve.tools.simulate.profile import Profile


def cell(max_tokens, wall_s, accepted=0, drafted=0, c=2, k=0, engine_steps=None):
    return Cell(system="x", concurrency=c, k=k, alpha=None, prompts=c, max_tokens=max_tokens,
                output_tokens=c * max_tokens, wall_s=wall_s, draft_tokens=drafted,
                accepted_tokens=accepted, steps_with_drafts=0, latency_per_token_ms_p50=0.0,
                engine_steps=engine_steps)


def test_step_point_is_a_difference_of_two_runs():
    """Target-only, 2 requests: 16 vs 64 tokens each, 1.0 s vs 2.44 s. The extra
    48 steps took 1.44 s: 30 ms per step of 2 tokens. With speculation at 3 tokens
    per request-step (2 accepted of 2 drafted), 64 tokens take 22 request-steps
    per request where 16 take 6 (rounding up): 16 extra batched steps of
    about 2 * (1 + 2) = 6 query tokens each."""
    x, ms = _step_point(cell(16, 1.0), cell(64, 2.44))
    assert (x, ms) == (pytest.approx(2.0), pytest.approx(30.0))
    short = cell(16, 1.0, accepted=2 * 10, drafted=2 * 10, k=2)   # 6 request-steps each
    long = cell(64, 1.8, accepted=2 * 42, drafted=2 * 44, k=2)    # 22 request-steps each
    x, ms = _step_point(short, long)
    assert x == pytest.approx((44 + 88 - 12 - 20) / 16)
    assert ms == pytest.approx(800 / 16)


def test_step_point_counts_the_engines_steps():
    """A = 1, K = 2, 2 requests. 17 tokens each: the prefill, 5 steps of 3, and
    a last step that verifies the 1 draft left and emits 1 token (its bonus
    falls past max_tokens): 7 engine steps, 11 drafts and 11 accepted per
    request, so output minus accepted reads 6 steps. 47 tokens: 1 + 15 x 3 +
    the same last step: 17 engine steps, 31 drafts per request. The engine's
    count gives 10 batched steps of 2 x 1 + 40 / 10 = 6 query tokens; output
    minus accepted would give 10 steps too here but reads short wherever the
    two runs' last steps differ, which is what the engine count is for."""
    short = cell(17, 1.0, accepted=22, drafted=22, k=2, engine_steps=7)
    long = cell(47, 1.5, accepted=62, drafted=62, k=2, engine_steps=17)
    x, ms = _step_point(short, long)
    assert x == pytest.approx((2 * 10 + 40) / 10)
    assert ms == pytest.approx(500 / 10)
    # where the counts disagree, the engine's wins
    x, ms = _step_point(short, cell(47, 1.5, accepted=62, drafted=62, k=2, engine_steps=22))
    assert ms == pytest.approx(500 / 15)


def test_the_overhead_is_against_a_step_of_as_many_tokens():
    """Steps cost 9 + 1 ms per query token; a speculative step 2 ms more. The
    A = 0 point verifies 5 tokens (the row and 4 rejected drafts), so its
    overhead is 16 - 14 = 2 ms against the target-only points at 5 tokens, not
    16 - 10 (the one-token target-only step); the A = 1 points hold the same
    overhead. The linear profile prices a prompt token at the line's 1 ms."""
    points = [
        {"system": "target_only", "alpha": None, "k": 0, "concurrency": 1, "tokens_per_step": 1.0, "step_ms": 10.0},
        {"system": "target_only", "alpha": None, "k": 0, "concurrency": 4, "tokens_per_step": 4.0, "step_ms": 13.0},
        {"system": "specserve_synthetic", "alpha": 1.0, "k": 4, "concurrency": 1, "tokens_per_step": 5.0, "step_ms": 16.0},
        {"system": "specserve_synthetic", "alpha": 1.0, "k": 4, "concurrency": 4, "tokens_per_step": 20.0, "step_ms": 31.0},
        {"system": "specserve_synthetic", "alpha": 0.0, "k": 4, "concurrency": 1, "tokens_per_step": 5.0, "step_ms": 16.0},
    ]
    for linear in (False, True):
        p = Profile.from_dict(profile_from_points(points, "test", linear=linear))
        assert p.target.spec_overhead_ms == pytest.approx(2.0)
        assert p.target.step(5.0) == pytest.approx(14.0)
        assert p.target.step(20.0) == pytest.approx(29.0)
        assert p.target.prefill_ms_per_token == (pytest.approx(1.0) if linear else 0.0)


def test_profile_from_points_takes_out_the_proposer_overhead():
    points = [
        {"system": "target_only", "alpha": None, "k": 0, "concurrency": 1, "tokens_per_step": 1.0, "step_ms": 10.0},
        {"system": "target_only", "alpha": None, "k": 0, "concurrency": 4, "tokens_per_step": 4.0, "step_ms": 13.0},
        {"system": "specserve_synthetic", "alpha": 1.0, "k": 4, "concurrency": 1, "tokens_per_step": 5.0, "step_ms": 16.0},
        {"system": "specserve_synthetic", "alpha": 0.0, "k": 4, "concurrency": 1, "tokens_per_step": 1.0, "step_ms": 12.0},
    ]
    prof = profile_from_points(points, "test")
    p = Profile.from_dict(prof)
    assert p.target.spec_overhead_ms == pytest.approx(2.0)
    assert p.target.step.points == ((1.0, 10.0), (4.0, 13.0), (5.0, 14.0))


def test_preflight_refuses_a_machine_without_gpu(tmp_path):
    if shutil.which("nvidia-smi") is not None:
        pytest.skip("this machine has an NVIDIA driver; the refusal is for machines without one")
    with pytest.raises(PreflightError, match="nvidia-smi"):
        preflight("gpu")
    assert main(["--preset", "gpu", "--out", str(tmp_path / "out")]) == 3
    assert not (tmp_path / "out").exists()  # nothing built before the preflight


@pytest.mark.slow
def test_tiny_gpu_check_end_to_end(tmp_path):
    """The CPU-sized form: random-weight tiny Llama, target-only and the synthetic
    draft at A in {0.6, 0.8}, K = 2, concurrency {1, 2}; JSON, Markdown, profile."""
    out = tmp_path / "tiny"
    r = subprocess.run([sys.executable, "-m", "specserve.tools.gpucheck", "--preset", "tiny",
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "preflight ok" in r.stderr and "done in" in r.stderr  # progress output
    data = json.loads((out / "results.json").read_text())
    assert data["skipped"] == []
    got = {(c["system"], c["k"], c["alpha"], c["concurrency"]) for c in data["cells"]}
    want = {("target_only", 0, None, c) for c in (1, 2)} | {
        ("specserve_k0", 4, None, c) for c in (1, 2)} | {
        ("specserve_synthetic", 2, a, c) for a in (0.6, 0.8) for c in (1, 2)}
    assert got == want
    for c in data["cells"]:
        assert c["output_tokens"] == c["prompts"] * c["max_tokens"]
        assert c["output_tokens_per_s"] > 0
        if c["system"] == "specserve_k0":
            # the proposer is there, no draft: no step had drafts, nothing predicted
            assert c["steps_with_drafts"] == 0 and c.get("predicted_tokens_per_s") is None
            continue
        assert c["predicted_tokens_per_s"] > 0
        if c["k"]:
            # drafts reached the target and some were accepted
            assert c["steps_with_drafts"] > 0 and c["accepted_tokens"] > 0
    # The A = 1 profile run: nearly every drafted token accepted.
    ones = [p for p in data["profile_points"] if p["alpha"] == 1.0]
    assert ones and all(p["tokens_per_step"] > 1.5 * p["concurrency"] for p in ones)
    profile = Profile.from_dict(json.loads((out / "profile.json").read_text()))
    # The data plane's grid ran first (no model), and its costs are in the profile.
    cell, = data["dataplane"]["cells"]
    assert (cell["rows"], cell["context"]) == (8, 1024)
    assert cell["propose_p50_ms"] > 0 and cell["ingest_tokens_per_s"] > 0
    assert profile.dataplane is not None
    assert profile.dataplane.propose_ms(8) == pytest.approx(cell["propose_p50_ms"])
    assert profile.dataplane.round_trip_ms(8) == pytest.approx(cell["round_trip_p50_ms"])
    md = (out / "results.md").read_text()
    assert "Data plane" in md
    assert "| specserve_synthetic | 2 | 0.8 | 2 |" in md
