"""The draft runner with a fake model and a fake link: run ahead, roll back."""

import asyncio

import pytest

from specserve.draft.runner import DraftRunner


def rule(seq):
    return (seq[-1] * 7 + 3) % 50


class FakeModel:
    """Greedy continuation by a fixed rule, one token per tick."""

    max_model_len = 1000

    def __init__(self):
        self.segments = []

    async def continue_tokens(self, segment_id, request_id, tokens, max_tokens):
        self.segments.append((request_id, len(tokens), max_tokens))
        seq = list(tokens)
        for _ in range(max_tokens):
            await asyncio.sleep(0)
            seq.append(rule(seq))
            yield [seq[-1]]


class FakeLink:
    def __init__(self):
        self.opened = {}
        self.drafts = []
        self.branches = []  # per send: [(fork position, tokens)]
        self.closed = []
        self.done = []  # (rid, end, last token)

    def open(self, rid, ticket, verified_position=0):
        self.opened[rid] = ticket

    def send_draft(self, rid, position, tokens, branches=()):
        self.drafts.append((rid, position, list(tokens)))
        self.branches.append([(f, list(t)) for f, t in branches])

    def send_done(self, rid, end, last):
        self.done.append((rid, end, last))

    def close_request(self, rid):
        self.closed.append(rid)

    async def close(self):
        pass


async def settle():
    for _ in range(50):
        await asyncio.sleep(0)


def make():
    link = FakeLink()
    runner = DraftRunner(FakeModel(), link_factory=lambda address: link)
    return runner, link


def expected(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(rule(seq))
    return seq


def test_runs_ahead_to_the_lookahead_and_streams_each_token():
    async def main():
        runner, link = make()
        runner.start("r", [1, 2], "sink:1", lookahead=5, max_tokens=100)
        await settle()
        assert link.opened["r"] == ""  # no ticket given: the sink would refuse it
        full = expected([1, 2], 5)
        # The link is handed the whole window from the verified position at every token.
        assert [d[2] for d in link.drafts] == [full[2 : 2 + i] for i in range(1, 6)]
        assert all(d[1] == 2 for d in link.drafts)
        assert runner.stats.drafted_tokens == 5  # stopped at W
        # The target verifies 3 of them: the draft extends to W past the new position.
        runner._on_verified("r", 2, full[2:5])
        await settle()
        assert link.drafts[-1] == ("r", 5, expected([1, 2], 8)[5:])
        await runner.close()

    asyncio.run(main())


def test_rejection_rolls_back_to_the_targets_history():
    async def main():
        runner, link = make()
        runner.start("r", [1, 2], "sink:1", lookahead=4, max_tokens=100)
        await settle()
        full = expected([1, 2], 4)
        # Target accepted the first draft token, then sampled 49 (not ours).
        runner._on_verified("r", 2, [full[2], 49])
        await settle()
        assert runner.stats.rollbacks == 1
        after = expected([1, 2, full[2], 49], 4)
        assert link.drafts[-1] == ("r", 4, after[4:])
        await runner.close()

    asyncio.run(main())


def test_target_ahead_of_the_draft_does_not_restart_a_consistent_segment():
    async def main():
        runner, link = make()
        runner.start("r", [1, 2], "sink:1", lookahead=3, max_tokens=100)
        # Before the draft produced anything the target already decided 5 tokens,
        # the same ones the draft will produce (draft == target).
        runner._on_verified("r", 2, expected([1, 2], 5)[2:])
        await settle()
        assert runner.stats.rollbacks == 0
        # Only tokens past the target's position are sent.
        assert link.drafts and all(pos == 7 for _, pos, _ in link.drafts)
        assert link.drafts[-1][2] == expected([1, 2], 8)[7:]
        await runner.close()

    asyncio.run(main())


def test_never_drafts_past_max_tokens_and_cancel_closes():
    async def main():
        runner, link = make()
        runner.start("r", [1], "sink:1", lookahead=50, max_tokens=6)
        await settle()
        assert runner.stats.drafted_tokens == 6
        assert runner.cancel("r") and not runner.cancel("r")
        assert link.closed == ["r"]
        await runner.close()

    asyncio.run(main())


def test_many_requests_share_one_link_and_bad_starts_are_refused():
    async def main():
        runner, link = make()
        for i in range(10):
            runner.start(f"r{i}", [i + 1], "sink:1", lookahead=3, max_tokens=10)
        await settle()
        assert len(link.opened) == 10 and runner.active() == 10
        for bad in (dict(prompt=[]), dict(lookahead=0), dict(max_tokens=0)):
            args = dict(rid="x", prompt=[1], sink_address="sink:1", lookahead=2, max_tokens=2)
            args.update(bad)
            with pytest.raises(ValueError):
                runner.start(**args)
        with pytest.raises(ValueError):
            runner.start("r0", [1], "sink:1", 2, 2)
        await runner.close()

    asyncio.run(main())


def test_the_adapt_buffer_collects_the_verified_tokens_and_changes_no_draft():
    from specserve.adapt.buffer import AdaptBuffer

    async def run(adapt):
        link = FakeLink()
        runner = DraftRunner(FakeModel(), link_factory=lambda address: link, adapt=adapt)
        runner.start("r", [1, 2, 3], "sink:1", lookahead=4, max_tokens=100)
        runner.start("idle", [7, 8], "sink:1", lookahead=4, max_tokens=100)
        await settle()
        full = expected([1, 2, 3], 4)
        runner._on_verified("r", 3, full[3:5])  # two of ours accepted
        await settle()
        runner._on_verified("r", 5, [49])  # a rejection: the target's token
        await settle()
        runner._on_verified("r", 3, full[3:5])  # a stale update: nothing new
        runner.cancel("r")
        runner.cancel("idle")  # verified nothing: nothing kept
        await runner.close()
        return link.drafts

    buffer = AdaptBuffer(1000, 2, 100, heldout_share=0.2)
    assert asyncio.run(run(buffer)) == asyncio.run(run(None))
    [example] = buffer.train_examples() + buffer.heldout_examples()
    assert example.request_id == "r"
    assert example.context == [2, 3]  # the prompt's last max_context_tokens
    assert example.continuation == expected([1, 2, 3], 2)[3:] + [49]
    assert buffer.tokens == 5 and buffer.requests() == 1


# ---- branches ---------------------------------------------------------------------


class BranchingModel(FakeModel):
    """FakeModel plus alternatives: at each position the next-best tokens are
    rule(seq) + 1, + 2, ...; a branch continues with the rule from there."""

    def branches(self, request_id, tokens, fork, count, length):
        out = []
        for i in range(count):
            seq = list(tokens[:fork]) + [(rule(tokens[:fork]) + 1 + i) % 50]
            for _ in range(min(length, len(tokens) - fork - 1)):
                seq.append(rule(seq))
            out.append(seq[fork:])
        return out


def test_windows_carry_the_budgeted_branches_and_a_hit_continues_on_the_branch():
    from specserve.draft.runner import BranchPlan

    async def main():
        link = FakeLink()
        plan = BranchPlan(fan_out=2, budget=3, length=2)
        runner = DraftRunner(BranchingModel(), link_factory=lambda a: link, branches=plan)
        runner.start("r", [1, 2], "sink:1", lookahead=4, max_tokens=100)
        await settle()
        full = expected([1, 2], 4)
        last = link.branches[-1]
        # The budget of 3, split by the geometric rule (prior alpha 0.8): one
        # alternative at each of the first three window positions.
        assert [f for f, _ in last] == [2, 3, 4]
        # Branches grow one token per draft step, up to `length`.
        assert all(len(t) <= 1 + 2 and len(t) <= 1 + len(full) - f - 1 for f, t in last)
        fork2 = dict(((f, t[0]), t) for f, t in last)
        # The target accepts full[2], rejects full[3] and samples our branch's token.
        alt = (rule(full[:3]) + 1) % 50
        branch = fork2[(3, alt)]
        runner._on_verified("r", 2, [full[2], alt])
        await settle()
        assert runner.stats.branches_taken == 1 and runner.stats.rollbacks == 1
        # The next window starts with the branch's continuation, then drafts on.
        pos, window = link.drafts[-1][1], link.drafts[-1][2]
        assert pos == 4 and window[: len(branch) - 1] == branch[1:]
        assert window == expected([1, 2, full[2], alt], 4)[4:]
        # A rejection with a token we had no branch for restarts from the target's.
        runner._on_verified("r", 4, [window[0], 49])
        await settle()
        assert runner.stats.branches_taken == 1 and runner.stats.rollbacks == 2
        await runner.close()

    asyncio.run(main())


def test_no_branches_without_a_plan_or_a_model_that_branches():
    from specserve.draft.runner import BranchPlan

    async def main():
        for model, plan in ((BranchingModel(), None), (FakeModel(), BranchPlan()),
                            (BranchingModel(), BranchPlan(fan_out=0))):
            link = FakeLink()
            runner = DraftRunner(model, link_factory=lambda a, link=link: link, branches=plan)
            runner.start("r", [1, 2], "sink:1", lookahead=4, max_tokens=100)
            await settle()
            assert link.drafts and not any(link.branches)
            await runner.close()

    asyncio.run(main())


def test_the_vllm_draft_model_branches_from_its_logprobs():
    """VllmDraftModel with a fake engine: alternatives come from the main line's
    logprobs, continuations from one more engine request per branch."""
    import types

    from specserve.draft.model import VllmDraftModel

    class Lp:
        def __init__(self, logprob):
            self.logprob = logprob

    class Engine:
        def __init__(self):
            self.requests = []

        async def generate(self, prompt, params, request_id):
            seq = list(prompt["prompt_token_ids"])
            self.requests.append((request_id, len(seq), params.logprobs))
            for _ in range(params.max_tokens):
                await asyncio.sleep(0)
                tok = rule(seq)
                lps = None
                if params.logprobs:
                    lps = [{tok: Lp(-0.1), (tok + 1) % 50: Lp(-1.0), (tok + 2) % 50: Lp(-2.0)}]
                seq.append(tok)
                yield types.SimpleNamespace(outputs=[types.SimpleNamespace(
                    token_ids=[tok], logprobs=lps)])

    async def main():
        from specserve.draft.runner import BranchPlan

        engine = Engine()
        model = VllmDraftModel(engine, 1000, fan_out=2)
        link = FakeLink()
        runner = DraftRunner(model, link_factory=lambda a: link,
                             branches=BranchPlan(fan_out=2, budget=2, length=2))
        runner.start("r", [1, 2], "sink:1", lookahead=3, max_tokens=100)
        for _ in range(5):
            await settle()
        main_line = expected([1, 2], 3)
        assert engine.requests[0][2] == 3  # top F + 1 logprobs on the main line
        alt = (main_line[2] + 1) % 50
        # Branch continuations ran as their own engine requests ...
        assert any(rid.startswith("r@2:") for rid, _, _ in engine.requests)
        # ... and later windows carry them, continued by the model's own rule.
        sent = dict(((f, t[0]), t) for f, t in link.branches[-1])
        assert (2, alt) in sent
        assert sent[(2, alt)][1:] == expected([1, 2, alt], 2)[3:][: len(sent[(2, alt)]) - 1]
        runner.cancel("r")
        assert not model._tasks and not model._alts
        await runner.close()

    asyncio.run(main())


def test_the_budget_covers_only_the_positions_the_next_step_can_reject():
    from specserve.draft.runner import BranchPlan

    async def main():
        link = FakeLink()
        runner = DraftRunner(BranchingModel(), link_factory=lambda a: link,
                             branches=BranchPlan(fan_out=3, budget=12, length=2, positions=3))
        runner.start("r", [1, 2], "sink:1", lookahead=8, max_tokens=100)
        await settle()
        forks = [f for f, _ in link.branches[-1]]
        assert set(forks) == {2, 3, 4} and len(forks) == 9  # K + 1 = 3 positions, F each
        await runner.close()

    asyncio.run(main())


def test_a_draft_ahead_of_the_window_still_sends_branches_for_the_new_positions():
    from specserve.draft.runner import BranchPlan

    async def main():
        link = FakeLink()
        runner = DraftRunner(BranchingModel(), link_factory=lambda a: link,
                             branches=BranchPlan(fan_out=1, budget=2, length=2, positions=2))
        runner.start("r", [1, 2], "sink:1", lookahead=6, max_tokens=100)
        await settle()
        full = expected([1, 2], 6)
        drafted = runner.stats.drafted_tokens
        # The draft stopped W ahead. The target accepts 2 tokens: right away,
        # before drafting any new token, the draft re-sends its window from the
        # new verified position with branches forking there.
        runner._on_verified("r", 2, full[2:4])
        pos, window = link.drafts[-1][1], link.drafts[-1][2]
        assert pos == 4 and window == full[4:] and runner.stats.drafted_tokens == drafted
        assert [f for f, _ in link.branches[-1]] == [4, 5]
        await runner.close()

    asyncio.run(main())



def test_a_request_the_sink_releases_stops_being_drafted():
    """The sink gave the request up (its drafts came too late): the runner stops
    drafting it and closes it on the link; it stays assigned until the caller
    cancels it, and updates that still come for it are ignored."""
    async def main():
        runner, link = make()
        runner.start("r", [1, 2], "sink:1", lookahead=5, max_tokens=100)
        runner.start("other", [3], "sink:1", lookahead=5, max_tokens=100)
        await settle()
        runner.release("r")
        await settle()
        assert link.closed == ["r"]
        assert runner.active() == 1 and runner.assigned() == 2 and runner.released() == 1
        assert runner.stats.released == 1
        sent = len(link.drafts)
        runner._on_verified("r", 2, expected([1, 2], 3)[2:])
        await settle()
        assert [d for d in link.drafts[sent:] if d[0] == "r"] == []
        runner.release("r")  # again, or for an unknown request: nothing
        runner.release("nope")
        assert runner.stats.released == 1
        assert runner.cancel("r") and runner.assigned() == 1 and not runner.cancel("r")
        assert runner.released() == 0 and runner.stats.released == 1
        assert link.closed == ["r"]  # closed once
        await runner.close()

    asyncio.run(main())


def test_released_requests_reach_the_draft_autoscaler_as_late():
    """A replica's figures, as Serve hands them to the draft policy: requests
    the sink released are reported, and counted as uncovered and late, though
    the one request still drafted hears no update that finds it behind."""
    from types import SimpleNamespace

    from deployments.draft import DraftServer
    from specserve.control.autoscale import draft_policy

    def decide(figures):
        ctx = SimpleNamespace(
            aggregated_metrics={k: {"replica-1": v} for k, v in figures.items()},
            current_num_replicas=1, capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=2, policy_state={}, deployment_name="draft-x")
        return draft_policy(ctx)

    async def main():
        runner, _ = make()
        server = DraftServer.__new__(DraftServer)  # its figures, without an engine
        server.runner = runner
        for rid in ("a", "b", "c"):
            runner.start(rid, [1, 2], "sink:1", lookahead=5, max_tokens=100)
        await settle()
        figures = server.record_autoscaling_stats()
        assert figures == {"coverage": 1.0, "lag": 0.0, "active": 3.0, "released": 0.0}
        assert decide(figures)[1]["reason"] == "keeping up"
        runner.release("a")
        runner.release("b")
        figures = server.record_autoscaling_stats()
        assert figures["active"] == 3.0 and figures["released"] == 2.0
        replicas, state = decide(figures)
        assert replicas == 2 and "2.0 released" in state["reason"], state
        await runner.close()

    asyncio.run(main())
