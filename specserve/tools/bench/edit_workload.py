"""The edit / agentic workload: prompts whose answers repeat long spans of their input.

Owns generating it, in Spec-Bench's JSONL format (question_id, category, turns)
so `specserve bench --prompts` reads it like any other, from a fixed seed (the
same file every time; `specserve/data/edit_sample.jsonl` is its output, checked
by tests/tools/test_edit_workload.py). Pure: text in, text out.

Categories (one user turn each: the bench sends the first turn only):
- edit: rewrite a paragraph with one word replaced;
- json_fix: repair a JSON object with one syntax error;
- code_edit: rename a function in a small Python file and print the whole file;
- trace: continue a tool-call / log trace in the same format;
- multi_turn: an earlier answer quoted back, asked to be repeated with one more sentence;
- family: near-identical requests (one template, a name changed), the answers
  alike across requests: what a memory shared across requests (and target
  replicas) drafts from.

Regenerate the shipped file: `python -m specserve.tools.bench.edit_workload`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SEED = 26
PER_CATEGORY = 4
SAMPLE = Path(__file__).resolve().parents[2] / "data" / "edit_sample.jsonl"

_WORDS = ("the system reads each request and keeps a short record of what it saw before "
          "so that the next answer can start from the same place while the user checks "
          "every line for errors and marks the parts that need a change in the final "
          "version of the report which goes out to the team on monday morning").split()
_NAMES = ["Alice", "Bruno", "Chen", "Dara", "Emeka", "Farah", "Goran", "Hana"]
_TEAMS = ["billing", "search", "platform", "support"]
_TOOLS = ["search_docs", "read_file", "run_tests", "open_ticket"]


def _paragraph(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + "."


def _edit(rng):
    text = _paragraph(rng, 60)
    old = rng.choice(sorted({w for w in text.lower().split() if w.isalpha() and len(w) > 3}))
    new = rng.choice(["request", "answer", "record", "review"])
    return (f"Rewrite the following paragraph exactly, but replace every '{old}' with "
            f"'{new}'. Output only the rewritten paragraph.\n\n{text}")


def _json_fix(rng):
    obj = {f"field_{i}": rng.choice([rng.randrange(1000), rng.choice(_WORDS),
                                     [rng.randrange(10) for _ in range(3)]])
           for i in range(10)}
    text = json.dumps(obj, indent=2)
    cut = text.rfind('"', 0, len(text) // 2)  # drop one quote: a syntax error
    return ("The JSON below has one syntax error. Output the corrected JSON only, "
            f"unchanged otherwise.\n\n{text[:cut]}{text[cut + 1:]}")


def _code_edit(rng):
    name = rng.choice(["load_rows", "parse_line", "fetch_user", "count_words"])
    body = "\n\n".join(
        f"def {name if i == 0 else f'helper_{i}'}(items):\n"
        f"    result = []\n    for item in items:\n"
        f"        if item > {rng.randrange(100)}:\n            result.append(item * {i + 2})\n"
        f"    return result" for i in range(4))
    caller = f"\n\n\ndef main(data):\n    return {name}(data) + helper_1(data)\n"
    return (f"Rename the function `{name}` to `{name}_v2` everywhere in this file and "
            f"output the whole file.\n\n```python\n{body}{caller}```")


def _trace(rng):
    lines = []
    for step in range(12):
        tool = rng.choice(_TOOLS)
        lines.append(f'{{"step": {step}, "tool": "{tool}", "args": {{"query": '
                     f'"{rng.choice(_WORDS)} {rng.choice(_WORDS)}"}}, "status": "ok"}}')
    return ("Here is an agent's tool-call trace, one JSON object per line. Continue it "
            "with the next 6 lines in exactly the same format.\n\n" + "\n".join(lines))


def _multi_turn(rng):
    answer = _paragraph(rng, 50)
    return (f"Earlier in this conversation you answered:\n\n{answer}\n\nRepeat that "
            "answer word for word, then add one sentence that summarises it.")


def _family(rng, i):
    name, team = _NAMES[i % len(_NAMES)], _TEAMS[0]
    return (f"Write the standard welcome email for a new member of the {team} team. "
            f"The new member is {name}. Use this template and fill it in:\n\nSubject: "
            f"Welcome to the {team} team\n\nHi NAME,\n\nWelcome to the {team} team! Your "
            "first week: on Monday you meet your mentor, on Tuesday you get access to the "
            "dashboards, on Wednesday you join the planning meeting, and on Friday you ship "
            "your first change. Ask anything in the team channel.\n\nBest,\nThe team")


def generate(seed: int = SEED, per_category: int = PER_CATEGORY) -> list[dict]:
    """The workload's records, in category order."""
    rng = random.Random(seed)
    makers = [("edit", _edit), ("json_fix", _json_fix), ("code_edit", _code_edit),
              ("trace", _trace), ("multi_turn", _multi_turn)]
    out = []
    for cat, make in makers:
        for i in range(per_category):
            out.append({"question_id": f"{cat}-{i}", "category": cat, "turns": [make(rng)]})
    return out + family(per_category, rng)


def family(n: int, rng: random.Random | None = None) -> list[dict]:
    """n members of the family category: one template, the name changed (the
    records' order is the members')."""
    rng = rng or random.Random(SEED)
    return [{"question_id": f"family-{i}", "category": "family", "turns": [_family(rng, i)]}
            for i in range(n)]


def render(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    SAMPLE.write_text(render(generate()))
    print(SAMPLE)
