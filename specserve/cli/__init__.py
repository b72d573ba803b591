"""The `specserve` command line (`specserve.cli:main`, `python -m specserve.cli`).

Owns dispatching a command and the edge's contract: bad input is a one-line
error and exit code 2, before any engine starts. Commands:

  specserve generate         prompts through a local draft worker + target (cli/generate.py)
  specserve serve            the Ray Serve app with the OpenAI API (cli/serve.py)
  specserve bench            target-only, vLLM's draft_model and specserve side by side
  specserve bench dataplane  the draft -> target data plane alone (no model; tools/bench/dataplane.py)
  specserve bench routing    target routing by prefix vs Serve's default (tools/bench/routing.py)
  specserve bench fleet      the fleet suffix memory vs each request's own (tools/bench/fleet.py)
  specserve distill          distil a draft out of a target's own layers (cli/tools.py)
  specserve models default   make the default model and its draft available in the local cache
  specserve simulate         capacity simulator (pure; specserve/tools/simulate/)

`generate --json` prints exactly one JSON object on stdout; everything else
(vLLM's logs included) goes to stderr. SIGTERM (`kill`, `timeout`) ends every
command the way Ctrl-C does: the engines it started are shut down on the way
out (exit 143), never left running without it (`serve` has its own handler).
"""

from __future__ import annotations

import logging
import signal
import sys

from specserve.cli.common import UsageError
from specserve.cli.generate import run_generate
from specserve.cli.parser import build_parser
from specserve.cli.serve import run_serve
from specserve.cli.tools import run_bench, run_distill

__all__ = ["UsageError", "build_parser", "main"]


class Terminated(BaseException):
    """SIGTERM, raised where the main thread is, so that every `finally` and
    `async with` on the way out runs (engines shut down); Python's default
    would end the process at once and orphan vLLM's engine processes."""


def _terminate(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command != "serve":
        signal.signal(signal.SIGTERM, _terminate)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "bench":
            return run_bench(args)
        if args.command == "distill":
            return run_distill(args)
        if args.command == "simulate":
            from specserve.tools.simulate.cli import run as run_simulate

            return run_simulate(args)
        if args.command == "adapt":
            from specserve.cli.adapt import run as run_adapt

            return run_adapt(args)
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
    except Terminated:
        print("specserve: terminated (SIGTERM); engines shut down", file=sys.stderr)
        return 143
    return 2
