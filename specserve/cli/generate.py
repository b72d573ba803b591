"""`specserve generate`: prompts through a local draft worker and target engine.

Owns the command's checks (models, tokenizers, K and W, TLS files, TP against
the cores here, prompts against the context) and printing the result: one JSON
object with --json, text otherwise. The engines are `specserve.local.LocalSpec`.
"""

from __future__ import annotations

import asyncio
import json
import os

from specserve.cli.common import UsageError, draft_dir, model_dir, results_on_stdout


def check_generate(args) -> tuple[str, str | None, int]:
    from specserve.config import lookahead_problem, lookahead_tokens
    from specserve.models import ensure_default_model, tokenizers_compatible

    target = (model_dir(args.target, "target") if args.target
              else str(ensure_default_model()))
    from specserve.draft import hybrid, suffix, synthetic

    model_folder = None  # the draft model's folder, where there is one
    if suffix.is_suffix(args.draft):
        draft = suffix.NAME
    elif hybrid.is_hybrid(args.draft):
        try:
            model_folder = draft_dir(hybrid.model_of(args.draft))
        except ValueError as e:
            raise UsageError(str(e)) from None
        draft = hybrid.PREFIX + model_folder
    elif synthetic.is_synthetic(args.draft):
        try:
            draft = str(synthetic.parse(args.draft))
        except ValueError as e:
            raise UsageError(str(e)) from None
    else:
        draft = model_folder = None if args.draft.lower() == "none" else draft_dir(args.draft)
    k = args.num_speculative_tokens
    lookahead = lookahead_tokens(k, args.lookahead)
    if model_folder is not None:
        problem = tokenizers_compatible(target, model_folder)
        if problem:
            raise UsageError(problem)
    problem = lookahead_problem(k, args.lookahead, "--num-speculative-tokens", "--lookahead")
    if draft is not None and problem:
        raise UsageError(problem)
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

    from specserve.engine import EngineSettings
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


def run_generate(args) -> int:
    target, draft, lookahead = check_generate(args)
    with results_on_stdout():
        result = asyncio.run(_generate(args, target, draft, lookahead))
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
