"""A stand-alone draft process: a draft model behind the Drafter gRPC service.

Owns the process: starts the draft worker (specserve/draft/worker.py: the draft
model, vLLM or the synthetic replay, and its DraftRunner) behind a gRPC server
with Start / Cancel / Health, then runs until SIGTERM or SIGINT. `specserve generate` starts one of these per run; it is also
how a draft replica runs outside Ray.

    python -m specserve.draft.server --model PATH --port P [--max-model-len N]
    python -m specserve.draft.server --model synthetic:A[@Dms] --replay FILE \
        --vocab-size V --port P [--seed S]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import grpc

from specserve.config import SpeculationConfig
from specserve.draft.runner import DraftRunner
from specserve.v1 import spec_pb2, spec_pb2_grpc

log = logging.getLogger("specserve.draft")


class DrafterService(spec_pb2_grpc.DrafterServicer):
    """Adapts Drafter RPCs to the runner; validation errors become status codes."""

    def __init__(self, runner: DraftRunner):
        self.runner = runner

    async def Start(self, request, context):
        try:
            self.runner.start(
                request.request_id,
                list(request.prompt_token_ids),
                request.sink_address,
                lookahead=request.lookahead,
                max_tokens=request.max_tokens,
                k=request.max_draft_tokens,
                ticket=request.ticket,
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return spec_pb2.DraftAck(ok=True)

    async def Cancel(self, request, context):
        found = self.runner.cancel(request.request_id)
        return spec_pb2.DraftAck(ok=found, message="" if found else "unknown request")

    async def Health(self, request, context):
        return spec_pb2.DraftAck(ok=True, message=f"active={self.runner.active()}")


async def serve(args) -> None:
    from specserve.draft.runner import BranchPlan
    from specserve.draft.worker import DraftWorker
    from specserve.engine import EngineSettings

    tls = None
    if args.tls_ca:
        from specserve.tls import TlsFiles

        tls = TlsFiles(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    settings = EngineSettings(
        max_model_len=args.max_model_len, seed=args.seed, dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib, max_num_seqs=args.max_num_seqs)
    try:
        plan = BranchPlan(args.branch_fan_out, args.branch_budget, args.branch_len,
                          args.branch_positions or None)
        suffix = None
        if args.suffix:
            from specserve.config import SuffixConfig

            suffix = SuffixConfig.model_validate_json(args.suffix)
        worker = DraftWorker.start(args.model, settings, tls=tls, replay_path=args.replay,
                                   vocab_size=args.vocab_size, branches=plan,
                                   name=args.name or args.model, suffix=suffix)
    except ValueError as e:  # a bad --suffix too (pydantic errors are ValueErrors)
        raise SystemExit(f"draft: {e}") from None
    server = grpc.aio.server()
    spec_pb2_grpc.add_DrafterServicer_to_server(DrafterService(worker.runner), server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    log.info("draft %s serving Drafter on %s:%d", args.model, args.host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)
    await worker.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m specserve.draft.server")
    p.add_argument("--model", required=True,
                   help="draft model folder, synthetic:A[@Dms] (see specserve.draft.synthetic) "
                        "or suffix (no model: specserve.draft.suffix)")
    p.add_argument("--suffix", default=None,
                   help="suffix only: its SuffixConfig as JSON (default: the config's defaults)")
    p.add_argument("--replay", default=None,
                   help="synthetic only: JSON lines of the target's greedy outputs to replay")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="synthetic only: the target's vocabulary size (corrupted ids stay below)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-gib", type=int, default=None)
    # Pre-drafted outcomes: F, the budget, the length (SpeculationConfig's defaults).
    spec = SpeculationConfig()
    p.add_argument("--branch-fan-out", type=int, default=spec.branch_fan_out)
    p.add_argument("--branch-budget", type=int, default=spec.branch_alternatives())
    p.add_argument("--branch-len", type=int, default=spec.branch_tokens())
    p.add_argument("--branch-positions", type=int, default=0,
                   help="window positions the budget covers (K + 1; 0: the whole window)")
    p.add_argument("--name", default=None,
                   help='"model/replica" the sinks name this draft by (default: --model)')
    # Mutual TLS to the sinks (all three files, or none: plaintext).
    p.add_argument("--tls-ca", default=None)
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--tls-server-name", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr,
        format="%(asctime)s draft %(levelname)s %(name)s: %(message)s",
    )
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
