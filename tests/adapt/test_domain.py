"""The tool-call domain: reproducible from its seed; the held-out half never
repeats a training request; every prompt carries the same tool schemas."""

from __future__ import annotations

from specserve.adapt import domain


def test_domain_is_reproducible_and_its_halves_are_disjoint():
    train, held = domain.domain_split(96, 32, seed=0)
    assert (train, held) == domain.domain_split(96, 32, seed=0)
    assert len(train) == 96 and len(held) == 32
    assert not {c[1]["content"] for c in train} & {c[1]["content"] for c in held}
    assert all(c[0]["content"] == domain.SYSTEM for c in train + held)
    assert len({c[1]["content"] for c in train}) > 80  # varied values, one narrow domain
    assert domain.tool_call_prompts(5, seed=1) != domain.tool_call_prompts(5, seed=2)
