"""Hypothesis strategies for OpenAI request bodies: valid-ish ones and hostile
ones (wrong types, huge numbers, NaN, unicode, nested junk, missing fields,
bytes that are not JSON). Shared by the parser fuzz test and the live-app one."""

import json

from hypothesis import strategies as st

MODEL = "tiny"

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)


def either(valid):
    """Mostly a valid value, sometimes junk."""
    return st.one_of(valid, valid, junk)


common = {
    "model": either(st.just(MODEL)) | st.text(max_size=10),
    "max_tokens": either(st.integers(1, 6)) | st.integers(-5, 2**40),
    "temperature": either(st.sampled_from([0, 0.0])) | st.floats(-3, 5),
    "top_p": either(st.floats(0.01, 1.0)),
    # (top_k at temperature > 0 once killed the speculating engine: issue 25)
    "top_k": either(st.sampled_from([-1, 0, 1, 2, 50])) | st.integers(-5, 10**6),
    "min_p": either(st.floats(0.0, 1.0)),
    "seed": either(st.integers(0, 2**31)),
    "stop": either(st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4),
                                                              max_size=3)),
    "stream": either(st.booleans()),
    "stream_options": either(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "n": either(st.just(1)) | st.integers(-2, 5),
    "ignore_eos": either(st.booleans()),
    "user": junk,
}
# Fields no request class has (a third of the bodies): the app answers 400.
unknown = st.one_of(st.just({}), st.just({}),
                    st.dictionaries(st.text(min_size=1, max_size=12).map(lambda k: "x-" + k),
                                    junk, min_size=1, max_size=2))

completion = st.builds(lambda extra, body: {**extra, **body}, unknown, st.fixed_dictionaries(
    {}, optional={
        **common,
        "prompt": either(st.text(max_size=60)) | st.lists(st.text(max_size=10), max_size=3)
        | st.lists(st.integers(-5, 100000), max_size=8),
    }))

message = st.fixed_dictionaries(
    {"role": either(st.sampled_from(["user", "system", "assistant"])) | st.text(max_size=8),
     "content": either(st.text(max_size=40))},
    optional={"name": junk, "tool_calls": junk})

chat = st.builds(lambda extra, body: {**extra, **body}, unknown, st.fixed_dictionaries(
    {}, optional={
        **common,
        "messages": either(st.lists(message, min_size=1, max_size=3))
        | st.lists(junk, max_size=3),
    }))


def encoded(bodies):
    """JSON bytes (NaN/Infinity allowed, as hostile clients send them), or raw junk."""
    return st.one_of(bodies.map(lambda b: json.dumps(b).encode()),
                     bodies.map(lambda b: json.dumps(b, ensure_ascii=False).encode()),
                     junk.map(lambda b: json.dumps(b).encode()),
                     st.binary(max_size=200))


completion_bytes = encoded(completion)
chat_bytes = encoded(chat)
