"""The per-request quotas (`quotas` in the config), as pure checks.

Two moments see a request: its JSON body before vLLM parses it
(`body_problem`: n, best_of, an explicit max_tokens; run by
`specserve.target.openai_app`'s request gate), and each engine request after
vLLM's tokenization and chat template (`prompt_problem`, `completion_tokens`:
run by `specserve.target.drafting.DraftingEngine.generate`). A problem is
(field, message) for an HTTP 400 naming the field and the config key that
sets the limit.

Never does: I/O, or parse anything (the body comes parsed, vLLM validates
the fields' types: a value of the wrong type is left to it).
"""

from __future__ import annotations

from specserve.config.quotas import QuotaConfig

Problem = tuple[str, str]  # (request field, message)


def _int(value) -> int | None:
    """value when it is an int (not a bool: vLLM refuses those itself)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prompts_in(body: dict) -> int:
    """How many prompts a completions body holds: a list of strings or of
    token-id lists is one prompt each; a string or one token-id list is one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def body_problem(body: dict, q: QuotaConfig) -> Problem | None:
    """What in a request body is over the quotas (first found), or None."""
    for field in ("n", "best_of"):
        n = _int(body.get(field))
        if n is None:
            continue
        prompts = prompts_in(body)
        if n * prompts > q.max_n:
            of = f"{n} × {prompts} prompts = {n * prompts}" if prompts > 1 else str(n)
            return (field, f"{field} asks for {of} sequences; this server generates at most "
                           f"{q.max_n} per request (quotas.max_n)")
    if q.max_completion_tokens is not None:
        for field in ("max_tokens", "max_completion_tokens"):
            asked = _int(body.get(field))
            if asked is not None and asked > q.max_completion_tokens:
                return (field, f"{field} is {asked}; this server generates at most "
                               f"{q.max_completion_tokens} tokens per sequence "
                               "(quotas.max_completion_tokens)")
    return None


def prompt_problem(prompt_tokens: int, q: QuotaConfig) -> Problem | None:
    """A prompt of `prompt_tokens` tokens over the quota, or None."""
    if q.max_prompt_tokens is not None and prompt_tokens > q.max_prompt_tokens:
        return ("prompt", f"the prompt has {prompt_tokens} tokens; this server accepts at "
                          f"most {q.max_prompt_tokens} (quotas.max_prompt_tokens)")
    return None


def completion_tokens(max_tokens: int | None, q: QuotaConfig) -> int | None:
    """The engine request's max_tokens within the quota: a body that named a
    larger one was refused already (`body_problem`), so this only bounds the
    default vLLM fills in (the rest of the context)."""
    cap = q.max_completion_tokens
    if cap is None or (max_tokens is not None and max_tokens <= cap):
        return max_tokens
    return cap
