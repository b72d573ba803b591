"""The edges of the tool commands: `specserve bench` (`bench dataplane`, `bench routing`, `bench fleet`, `bench draftside`) and `specserve distill`.

Owns checking their models and flags (one line, exit 2) and printing what
they return; the bodies are `specserve.tools.bench` and
`specserve.tools.distill`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from specserve.cli.common import UsageError, default_draft, draft_dir, model_dir, results_on_stdout


def run_bench(args) -> int:
    """`specserve bench`: the body is specserve/tools/bench/; here only the edge."""
    if getattr(args, "bench_command", None) == "dataplane":
        return run_dataplane(args)
    if getattr(args, "bench_command", None) == "routing":
        return run_routing(args)
    if getattr(args, "bench_command", None) == "draftside":
        return run_draftside(args)
    if getattr(args, "bench_command", None) == "fleet":
        return run_fleet(args)
    from specserve.tools.bench import report as bench_report
    from specserve.tools.bench import run as bench
    from specserve.models import ensure_default_model, tokenizers_compatible

    target = model_dir(args.target, "target") if args.target else str(ensure_default_model())
    if args.draft:
        draft = draft_dir(args.draft)
    elif args.target:
        draft = None
    else:
        draft = default_draft()
    needs_draft = {"vllm_draft_model", "specserve", "specserve_hybrid",
                   "specserve_http"} & set(args.systems)
    if draft is None and needs_draft:
        raise UsageError(f"systems {sorted(needs_draft)} need --draft PATH (a draft model "
                         "with the target's tokenizer); or choose --systems target_only "
                         "specserve_synthetic")
    if ("specserve_adapted" in args.systems) != (args.adapted_draft is not None):
        raise UsageError("--adapted-draft PATH and --systems ... specserve_adapted go together "
                         "(the row that runs the adapted draft)")
    if args.adapted_draft is not None:
        args.adapted_draft = draft_dir(args.adapted_draft)
    for folder in (draft, args.adapted_draft):
        problem = folder is not None and tokenizers_compatible(target, folder)
        if problem:
            raise UsageError(problem)
    try:
        bargs = bench.bench_args(args, target, draft)
    except ValueError as e:
        raise UsageError(str(e)) from None
    import tempfile

    with results_on_stdout(), tempfile.TemporaryDirectory(prefix="specserve-bench-") as work:
        try:
            report = asyncio.run(bench.run_bench(bargs, Path(work)))
        except ValueError as e:
            raise UsageError(str(e)) from None
    png = bench_report.write_outputs(report, args.json_path, args.plot)
    print(bench_report.markdown(report))
    print(f"specserve bench: plot written to {png}" +
          (f", results to {args.json_path}" if args.json_path else ""), file=sys.stderr)
    if report["greedy_mismatches"]:
        print("specserve bench: error: greedy output differs from target_only for "
              f"{len(report['greedy_mismatches'])} requests (see the table)", file=sys.stderr)
        return 1
    return 0


def run_dataplane(args) -> int:
    """`specserve bench dataplane`: the body is specserve/tools/bench/dataplane.py."""
    from specserve.tools.bench import dataplane
    from specserve.tools.bench.dataplane_workload import markdown, plan_from_args

    try:
        plan = plan_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    with results_on_stdout():
        report = dataplane.run(plan, capacity=not args.no_capacity)
    report["command"] = "specserve " + " ".join(args.argv)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    return 0


def run_routing(args) -> int:
    """`specserve bench routing`: the body is specserve/tools/bench/routing.py."""
    import tempfile

    from specserve.tools.bench import routing

    if args.target:
        args.target = model_dir(args.target, "target")
    with tempfile.TemporaryDirectory(prefix="specserve-bench-routing-") as work:
        report = routing.run(args, Path(work))
    print(routing.markdown(report))
    return 0


def run_fleet(args) -> int:
    """`specserve bench fleet`: the body is specserve/tools/bench/fleet.py."""
    import tempfile

    from specserve.tools.bench import fleet

    if args.target:
        args.target = model_dir(args.target, "target")
    try:
        fleet.check(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="specserve-bench-fleet-") as work:
        report = fleet.run(args, Path(work))
    print(fleet.markdown(report))
    return 0


def run_draftside(args) -> int:
    """`specserve bench draftside`: the body is specserve/tools/bench/draftside.py."""
    from specserve.tools.bench import draftside

    draft = draft_dir(args.draft) if args.draft else default_draft()
    return draftside.main(args, draft)


def run_distill(args) -> int:
    import shlex

    from specserve.tools.distill import run as distill
    from specserve.tools.distill.recipe import DistillError
    from specserve.models import ensure_default_model

    target = args.target or str(ensure_default_model())
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    command = "specserve " + shlex.join(args.argv)
    try:
        state = distill.run(target, args.layers, args.out, args.minutes,
                            train_tokens=args.train_tokens, data_minutes=args.data_minutes,
                            data_only=args.data_only, top_k=args.top_k, seed=args.seed,
                            threads=args.threads, lr=args.lr,
                            checkpoint_minutes=args.checkpoint_minutes,
                            eval_count=args.eval_prompts, answer_tokens=args.answer_tokens,
                            command=command)
    except DistillError as e:
        raise UsageError(str(e)) from None
    print(json.dumps({"out": str(Path(args.out).resolve()), "layers": state.layers,
                      "train_tokens": state.train_tokens, "eval_tokens": state.eval_tokens,
                      "alpha_before": state.alpha_before, "alpha_after": state.alpha_after,
                      "target_alpha": state.target_alpha,
                      "train_seconds": round(state.train_seconds, 1)}))
    return 0
