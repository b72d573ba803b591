"""The shipped distilled draft's recovery hit rate H at F = 1..4 on held-out text.

Held-out prompts (topics never used in training, specserve.tools.distill.run.
eval_prompts), answered greedily by the default target (transformers, float32);
at every answer position where the draft's greedy token is not the target's,
is the target's token among the draft's F next-best tokens? That is H for a
branch budget of F alternatives at a position (the synthetic draft's H).

    flock /tmp/specserve-heavy.lock python scripts/recovery_hit.py [--prompts 16]
"""

import argparse
import json
import sys

if __name__ == "__main__":
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.models import ensure_default_draft, ensure_default_model
    from specserve.tools.distill.draft import evaluate_recovery_hit
    from specserve.tools.distill.recipe import eval_prompts

    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    torch.set_num_threads(2)
    target_dir, draft_dir = ensure_default_model(), ensure_default_draft()
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    data = []
    with torch.no_grad():
        for text in eval_prompts(args.prompts):
            ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                          add_generation_prompt=True, return_tensors="pt")
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            out = target.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
            data.append({"ids": out[0].to(torch.int32), "start": ids.shape[1]})
            print(f"answered {len(data)}/{args.prompts}", file=sys.stderr)
    hit = evaluate_recovery_hit(draft, data)
    tokens = sum(len(d["ids"]) - d["start"] for d in data)
    print(json.dumps({"prompts": len(data), "answer_tokens": tokens,
                      "recovery_hit_rate": {str(f): round(h, 4) for f, h in hit.items()}}))
