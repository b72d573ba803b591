"""A narrow synthetic domain the shipped draft was not distilled on: tool calls.

Owns `tool_call_prompts`: chat prompts (system: a fixed set of tool schemas;
user: a request filled with random values from a seed) whose answers are JSON
tool calls, and `domain_split`, its training half and held-out half (the same
schemas, other values), and `bench_lines`, conversations as prompt-file lines
(Spec-Bench JSONL with a "system" key, what `specserve bench --prompts`
reads). Pure: strings from a seed, no model, no I/O.
"""

from __future__ import annotations

import json
import random

TOOLS = [
    {"name": "get_weather", "parameters": {"city": "string", "unit": "celsius|fahrenheit"}},
    {"name": "book_table", "parameters": {"restaurant": "string", "people": "integer",
                                          "date": "YYYY-MM-DD", "time": "HH:MM"}},
    {"name": "send_email", "parameters": {"to": "string", "subject": "string"}},
    {"name": "convert_currency", "parameters": {"amount": "number", "from": "string", "to": "string"}},
    {"name": "set_reminder", "parameters": {"text": "string", "date": "YYYY-MM-DD", "time": "HH:MM"}},
    {"name": "search_flights", "parameters": {"origin": "string", "destination": "string",
                                              "date": "YYYY-MM-DD"}},
]

SYSTEM = ("You are a function-calling assistant. Tools:\n" + json.dumps(TOOLS) +
          '\nAnswer with one JSON object {"name": ..., "arguments": {...}} and nothing else.')

CITIES = ["Paris", "Lima", "Osaka", "Berlin", "Nairobi", "Toronto", "Madrid", "Hanoi",
          "Oslo", "Cairo", "Denver", "Porto", "Seoul", "Quito", "Dublin", "Perth"]
NAMES = ["anna", "ben", "chloe", "diego", "emma", "farid", "grace", "hugo", "ines", "jun"]
PLACES = ["Le Petit Bistro", "Sushi Zen", "Casa Verde", "The Green Table", "Mama Rosa",
          "Blue Lotus", "El Faro", "Golden Dragon"]
CURRENCIES = ["USD", "EUR", "JPY", "GBP", "CHF", "CAD", "INR", "BRL"]
THINGS = ["call the dentist", "buy milk", "pay rent", "water the plants", "submit the report",
          "pick up the kids", "renew the passport", "book the car service"]
SUBJECTS = ["meeting notes", "invoice", "weekend plans", "project update", "lunch tomorrow"]


def _date(rng: random.Random) -> str:
    return f"2027-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _time(rng: random.Random) -> str:
    return f"{rng.randint(7, 21):02d}:{rng.choice(['00', '15', '30', '45'])}"


def _request(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return f"What's the weather in {rng.choice(CITIES)} in {rng.choice(['celsius', 'fahrenheit'])}?"
    if kind == 1:
        return (f"Book a table at {rng.choice(PLACES)} for {rng.randint(2, 9)} people on "
                f"{_date(rng)} at {_time(rng)}.")
    if kind == 2:
        return (f"Send an email to {rng.choice(NAMES)}@example.com with the subject "
                f"'{rng.choice(SUBJECTS)}'.")
    if kind == 3:
        a, b = rng.sample(CURRENCIES, 2)
        return f"Convert {rng.randint(5, 5000)} {a} to {b}."
    if kind == 4:
        return f"Remind me to {rng.choice(THINGS)} on {_date(rng)} at {_time(rng)}."
    a, b = rng.sample(CITIES, 2)
    return f"Find flights from {a} to {b} on {_date(rng)}."


def tool_call_prompts(count: int, seed: int) -> list[list[dict]]:
    """`count` chat conversations (system + user) of the domain, from `seed`."""
    rng = random.Random(f"tool-calls-{seed}")
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": _request(rng)}]
            for _ in range(count)]


def domain_split(train_count: int, heldout_count: int, seed: int = 0):
    """(training conversations, held-out conversations): same schemas, values
    drawn from different seeds; a held-out request never repeats a training one."""
    train = tool_call_prompts(train_count, seed)
    seen = {c[1]["content"] for c in train}
    heldout = [c for c in tool_call_prompts(heldout_count * 2, seed + 1_000_003)
               if c[1]["content"] not in seen][:heldout_count]
    return train, heldout


def bench_lines(conversations: list[list[dict]], name: str) -> list[str]:
    """One JSONL line per conversation: question_id NAME-i, category tool-calls,
    the system message and the user turn."""
    return [json.dumps({"question_id": f"{name}-{i}", "category": "tool-calls",
                        "system": c[0]["content"], "turns": [c[1]["content"]]}) + "\n"
            for i, c in enumerate(conversations)]
