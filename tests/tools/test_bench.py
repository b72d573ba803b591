"""`specserve bench`: its pure parts alone, then one real run on the tiny pair.

The real run starts every system (target-only, vLLM's draft_model, specserve
with the draft worker, the synthetic draft, the Ray Serve app over HTTP) at
concurrency 1 and 2 on a few short prompts, and checks the JSON (documented
keys and types for every row), the Markdown table, the PNG, and that every
system's greedy output equals target-only's (the bench asserts it itself and
exits 1 otherwise; the test checks the exit code and the JSON).
"""

import json

import pytest

from specserve.acceptance.record import Acceptance
from specserve.tools.bench import report, run, workload
from specserve.tools.bench import stats as benchstats
from specserve.tools.bench.backends import Counters, RequestResult
from specserve.tools.bench.workload import Prompt

# ---- pure -------------------------------------------------------------------------


def test_parse_and_select_prompts():
    lines = [json.dumps({"question_id": i, "category": c, "turns": [f"q{i}", "second"]})
             for i, c in enumerate(["a", "a", "a", "b", "c"])]
    prompts = workload.parse_prompts(lines + [""])
    assert [p.text for p in prompts] == ["q0", "q1", "q2", "q3", "q4"]
    picked = workload.select_prompts(prompts, 4)
    assert [p.category for p in picked] == ["a", "b", "c", "a"]  # categories in turn
    assert len(workload.select_prompts(prompts, 50)) == 5
    with pytest.raises(ValueError, match="Spec-Bench"):
        workload.parse_prompts(['{"category": "a"}'])
    with pytest.raises(ValueError, match="no prompts"):
        workload.parse_prompts([])


def test_a_prompt_may_carry_a_system_message():
    lines = [json.dumps({"question_id": 1, "category": "a", "turns": ["q"], "system": "be brief"}),
             json.dumps({"question_id": 2, "category": "a", "turns": ["r"]})]
    with_system, without = workload.parse_prompts(lines)
    assert with_system.messages() == [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "q"}]
    assert without.messages() == [{"role": "user", "content": "r"}]
    with pytest.raises(ValueError, match="system must be a string"):
        workload.parse_prompts([json.dumps({"turns": ["q"], "system": ["x"]})])


def test_the_shipped_sample_parses():
    prompts = workload.parse_prompts(workload.SAMPLE_PROMPTS.read_text().splitlines())
    assert len(prompts) == 23 and len({p.category for p in prompts}) == 13


def test_percentile_and_ratio():
    assert benchstats.ratio(3.0, 2.0) == 1.5 and benchstats.ratio(1.0, 0.0) is None


def result(tokens, start, first, end, cat="x"):
    return RequestResult(Prompt("q", cat, "t"), [1] * tokens, None, tokens, start, first, end,
                         Acceptance(k=2, output_tokens=tokens, draft_tokens=8,
                                    accepted_histogram=(1, 1, 2)))


def test_summarize_rows_and_comparisons():
    rs = [result(11, 0.0, 0.1, 1.1), result(11, 0.0, 0.2, 2.2)]
    base = report.summarize("target_only", 1, None, 0, rs, 2.0, None, speculative=False)
    assert base["output_tokens_per_s"] == 11.0
    assert base["tpot_p50_ms"] == pytest.approx(150.0) and base["ttft_p50_ms"] == pytest.approx(150.0)
    assert base["acceptance_rate"] is None and base["coverage"] is None
    fast = [result(11, 0.0, 0.1, 0.6), result(11, 0.0, 0.1, 0.6)]
    c = Counters(num_drafts=4, draft_tokens=16, accepted_tokens=8, accepted_per_position=[4, 3, 1, 0],
                 draft_per_position=[4, 4, 4, 4])
    syn = report.summarize("specserve_synthetic", 1, 0.8, 4, fast, 1.0, c, speculative=True)
    assert syn["acceptance_rate"] == 0.5 and syn["mean_accepted_length"] == 3.0
    assert syn["conditional_acceptance"] == pytest.approx(8 / (4 + 4 + 3 + 1))
    assert syn["coverage"] == pytest.approx(4 / 14) and syn["tokens_per_step"] == pytest.approx(22 / 14)
    rows = [base, syn]
    report.add_comparisons(rows)
    assert syn["speedup_vs_target_only"] == 2.0 and base["speedup_vs_target_only"] == 1.0
    assert syn["speedup_vs_vllm_draft_model"] is None
    # A verify step takes tpot * tokens/step over a target-only token's time.
    cost = syn["tpot_mean_ms"] * syn["tokens_per_step"] / base["tpot_mean_ms"]
    assert syn["verify_step_cost"] == pytest.approx(cost)
    assert syn["ideal_speedup"] == pytest.approx(benchstats.expected_tokens(0.8, 4) / cost)
    assert syn["share_of_ideal"] == pytest.approx(2.0 / syn["ideal_speedup"])
    # Without a draft delay a co-located draft could reach the ideal; with one
    # of D per draft step, K of them come before every verify step.
    assert syn["colocated_bound"] == pytest.approx(syn["ideal_speedup"])
    syn["synthetic_delay_ms"] = 25.0
    report.add_comparisons(rows)
    tpot0 = base["tpot_mean_ms"]
    assert syn["colocated_bound"] == pytest.approx(
        benchstats.expected_tokens(0.8, 4) / (cost + 4 * 25.0 / tpot0))
    assert syn["share_of_colocated"] == pytest.approx(2.0 / syn["colocated_bound"])


def test_category_rows_and_pooling():
    rs = [result(11, 0, 0.1, 1.1, "a"), result(11, 0, 0.1, 1.1, "b")]
    cats = report.category_rows("specserve", 1, None, rs)
    assert [r["category"] for r in cats] == ["a", "b"]
    assert cats[0]["acceptance_rate"] == pytest.approx(5 / 8)  # histogram [1,1,2]: 0+1+4
    assert cats[0]["mean_accepted_length"] == pytest.approx(1 + 5 / 4)
    r1 = report.summarize("target_only", 1, None, 0, rs, 2.0, None, False)
    r2 = report.summarize("target_only", 1, None, 0, rs, 4.0, None, False)
    pooled = report.pool([r1, r2])
    assert pooled["output_tokens"] == 44 and pooled["output_tokens_per_s"] == pytest.approx(44 / 6)


def test_each_rounds_ratios_beside_the_pooled_ones():
    def row(system, wall):  # 22 tokens in `wall` seconds
        return report.summarize(system, 1, None, 0, [result(11, 0, 0.1, 1.1)] * 2, wall, None,
                                False)

    rounds = [[row("vllm_serve", 2.0), row("specserve_http", 2.5)],
              [row("vllm_serve", 2.0), row("specserve_http", 2.0)]]
    pooled = [report.pool([a, b]) for a, b in zip(*rounds)]
    report.add_comparisons(pooled)
    report.add_round_ratios(pooled, rounds)
    assert pooled[1]["speedup_vs_vllm_serve"] == pytest.approx(44 / 4.5 / 11)
    assert pooled[1]["speedup_vs_vllm_serve_rounds"] == pytest.approx([0.8, 1.0])
    assert pooled[0]["speedup_vs_target_only_rounds"] == [None, None]
    assert rounds[0][1].get("speedup_vs_vllm_serve") is None  # the rounds' rows are untouched
    text = report.markdown({"results": pooled, "by_category": [], "notes": [],
                            "greedy_mismatches": []})
    section = text.split("Each round alone")[1]
    assert "| specserve_http | – | 1 | – | 0.80 / 1.00 | – |" in section
    assert "| vllm_serve | – | 1 | – | 1.00 / 1.00 | – |" in section


def test_markdown_lists_every_row():
    rows = [report.summarize(s, 1, a, 4, [result(3, 0, 0.1, 0.3)], 1.0, Counters(), s != "target_only")
            for s, a in [("target_only", None), ("specserve", None), ("specserve_synthetic", 0.8)]]
    report.add_comparisons(rows)
    text = report.markdown({"results": rows, "by_category": [], "notes": ["n"],
                           "greedy_mismatches": []})
    for s in ("target_only", "specserve", "specserve_synthetic"):
        assert f"| {s} |" in text
    assert "Note: n" in text
    assert "Each round alone" not in text  # one round: no per-round table


# ---- the real thing on the tiny pair ---------------------------------------------------

ROW_TYPES = {"system": str, "concurrency": int, "alpha": (float, type(None)),
             "output_tokens_per_s": float, "tpot_p50_ms": float, "ttft_p50_ms": float,
             "acceptance_rate": (float, type(None)), "mean_accepted_length": (float, type(None)),
             "coverage": (float, type(None))}


@pytest.mark.slow
def test_bench_on_the_tiny_pair(tiny_models, tmp_path):
    from conftest import run_cli

    prompts = tmp_path / "prompts.jsonl"
    cats = ["qa", "translation", "writing"]
    prompts.write_text("".join(
        json.dumps({"question_id": i, "category": cats[i % 3],
                    "turns": [f"Question {i}: what is {i} plus {i}?"],
                    **({"system": "Answer in one word."} if i == 0 else {})}) + "\n"
        for i in range(4)))
    out = tmp_path / "bench.json"
    # specserve_adapted: another draft folder beside --draft's, in the same run
    systems_run = (*workload.DEFAULT_SYSTEMS, "specserve_adapted")
    proc = run_cli("bench", "--target", str(tiny_models["target"]),
                   "--draft", str(tiny_models["perturbed"]), "--prompts", str(prompts),
                   "--num-prompts", "4", "--max-tokens", "24", "--concurrency", "1", "2",
                   "--synthetic-alpha", "0.8", "--json", str(out),
                   "--systems", *systems_run, "--adapted-draft", str(tiny_models["unrelated"]),
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    got = json.loads(out.read_text())
    rows = got["results"]
    systems = {(r["system"], r["concurrency"]) for r in rows}
    assert systems == {(s, c) for s in systems_run for c in (1, 2)}
    by = {(r["system"], r["concurrency"]): r for r in rows}
    # the adapted row ran its own draft folder: the unrelated model, which the
    # K controller may hold at K = 0 (no acceptance then), never above the
    # perturbed copy of the target
    adapted = by["specserve_adapted", 1]["accepted_tokens"] / max(
        by["specserve_adapted", 1]["draft_tokens"], 1)
    assert adapted <= (by["specserve", 1]["acceptance_rate"] or 0.0)
    for r in rows:
        for key, types in ROW_TYPES.items():
            assert isinstance(r[key], types), (key, r)
        assert r["output_tokens"] == 4 * 24 and r["requests"] == 4
        speculative = r["system"] != "target_only"
        if speculative:
            assert r["greedy_mismatches"] == 0, r
        assert (r["acceptance_rate"] is not None) == (speculative and r["draft_tokens"] > 0)
    syn = [r for r in rows if r["system"] == "specserve_synthetic"]
    assert all(r["alpha"] == 0.8 and r["ideal_speedup"] > 0 for r in syn)
    assert got["greedy_mismatches"] == []
    assert {c["category"] for c in got["by_category"]} == set(cats)
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for s in systems_run:
        assert f"| {s} |" in proc.stdout
    assert "[bench" in proc.stderr  # progress went to stderr
    # A run that succeeded says so without a traceback (vLLM's AsyncLLM.__del__
    # printed one at exit: engine.shutdown_engine).
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


class FakeBackend:
    """A backend without engines: output = prompt ids reversed, a few ms per token."""

    def __init__(self, system, alpha=None, wrong=False):
        self.system, self.alpha, self.k, self.wrong = system, alpha, 4, wrong
        self.c = Counters(draft_per_position=[0, 0, 0, 0], accepted_per_position=[0, 0, 0, 0])

    def counters(self):
        return Counters(**{**self.c.__dict__, "accepted_per_position":
                           list(self.c.accepted_per_position),
                           "draft_per_position": list(self.c.draft_per_position)})

    def extra(self):
        return {}

    async def generate(self, p, params):
        import asyncio
        import time

        start = time.monotonic()
        await asyncio.sleep(0.001)
        first = time.monotonic()
        ids = (list(reversed(p.ids)) * params["max_tokens"])[: params["max_tokens"]]
        if self.wrong:
            ids[-1] += 1
        await asyncio.sleep(0.001 * len(ids))
        if self.system != "target_only":
            self.c.num_drafts += 2
            self.c.draft_tokens += 8
            self.c.accepted_tokens += 3
            self.c.accepted_per_position = [a + d for a, d in
                                            zip(self.c.accepted_per_position, [2, 1, 0, 0])]
            self.c.draft_per_position = [d + 2 for d in self.c.draft_per_position]
        return RequestResult(p, ids, None, len(ids), start, first, time.monotonic())


def test_run_system_rows_and_the_greedy_check(tmp_path):
    import asyncio

    prompts = [Prompt(str(i), "ab"[i % 2], "t", [i + 1, i + 2]) for i in range(4)]
    a = workload.BenchArgs(target="t", draft="d", prompts_file=tmp_path, num_prompts=4,
                        max_tokens=6, temperature=0.0, concurrency=[1, 2], alphas=[],
                        k=4, systems=[])
    params = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    rows, cats, bad, first = asyncio.run(
        run.run_system(FakeBackend("target_only"), prompts, a, params, None))
    assert [r["concurrency"] for r in rows] == [1, 2] and not bad
    reference = {r.prompt.question_id: (r.token_ids, "") for r in first}
    rows, cats, bad, _ = asyncio.run(
        run.run_system(FakeBackend("specserve"), prompts, a, params, reference))
    assert [r["greedy_mismatches"] for r in rows] == [0, 0]
    # The warm-up request is not counted: 4 requests x 2 steps with drafts each.
    assert rows[0]["draft_tokens"] == 32 and rows[0]["accepted_per_position"] == [8, 4, 0, 0]
    assert {c["category"] for c in cats} == {"a", "b"}
    rows, _, bad, _ = asyncio.run(
        run.run_system(FakeBackend("specserve", wrong=True), prompts, a, params, reference))
    assert [r["greedy_mismatches"] for r in rows] == [4, 4] and len(bad) == 8
    assert bad[0]["got"][-1] == bad[0]["want"][-1] + 1


class FakeHttpBackend(FakeBackend):
    """An HTTP system: text only, no token ids."""

    async def start(self):
        pass

    async def close(self):
        pass

    async def generate(self, p, params):
        r = await super().generate(p, params)
        return RequestResult(p, None, " ".join(map(str, r.token_ids)), r.output_tokens,
                             r.start, r.first, r.end)


def test_without_target_only_greedy_texts_are_checked_against_the_first_system(
        tmp_path, monkeypatch):
    import asyncio

    import transformers

    prompts = [Prompt(str(i), "ab"[i % 2], "t", [i + 1, i + 2]) for i in range(4)]
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: object())
    monkeypatch.setattr(run, "load_workload", lambda a, tokenizer, max_len: (prompts, 0))
    started = []

    def backend(system, **kw):
        started.append(system)
        return FakeHttpBackend(system, **kw)

    monkeypatch.setattr(run, "build_backends", lambda a, replay, workdir: [
        ("vllm_serve", None, lambda: backend("vllm_serve")),
        ("specserve_http", None, lambda: backend("specserve_http", wrong=True))])
    a = workload.BenchArgs(target="t", draft="d", prompts_file=tmp_path, num_prompts=4,
                           max_tokens=6, temperature=0.0, concurrency=[1, 2], alphas=[], k=4,
                           systems=["vllm_serve", "specserve_http"], rounds=2)
    out = asyncio.run(run.run_bench(a, tmp_path))
    assert "greedy outputs compared with vllm_serve's (target_only not run)" in out["notes"]
    # The second round runs the systems in reverse order (the reference is kept).
    assert started == ["vllm_serve", "specserve_http", "specserve_http", "vllm_serve"]
    bad = out["greedy_mismatches"]
    assert {m["system"] for m in bad} == {"specserve_http"} and len(bad) == 2 * 2 * 4
    assert bad[0]["got"] != bad[0]["want"] and isinstance(bad[0]["want"], str)
    rows = {(r["system"], r["concurrency"]): r for r in out["results"]}
    assert rows[("specserve_http", 2)]["speedup_vs_vllm_serve_rounds"][1] is not None


def test_json_and_png_written(tmp_path):
    rows = [report.summarize(s, c, a, 4, [result(3, 0, 0.1, 0.3)], 1.0, Counters(),
                             s != "target_only")
            for s, a in [("target_only", None), ("specserve_synthetic", 0.8)] for c in (1, 8)]
    out = {"results": rows, "by_category": [], "notes": [], "greedy_mismatches": []}
    png = report.write_outputs(out, str(tmp_path / "b.json"), None)
    assert png == tmp_path / "b.png" and png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "b.json").read_text())["results"][0]["system"] == "target_only"


def test_vllm_serve_runs_vllms_server_with_the_targets_engine_settings(tmp_path):
    from specserve.engine import EngineSettings
    from specserve.tools.bench.vllm_serve import VllmServeBackend

    s = EngineSettings(max_model_len=512, seed=3, dtype="float32", kv_cache_gib=2)
    b = VllmServeBackend("/models/t", "/models/d", 4, s, tmp_path)
    cmd = b.command(8123)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(cmd)
    for part in ("--model /models/t", "--dtype float32", "--seed 3", "--max-num-seqs 64",
                 "--max-model-len 512", "--enforce-eager", "--enable-prefix-caching",
                 "--port 8123", f"--served-model-name {b.name}"):
        assert part in flags, (part, flags)
    assert b.env()["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert b.counters().draft_tokens == 0


def test_vllms_drafts_with_no_model_run_its_own_speculative_configs(tmp_path, monkeypatch):
    """vllm_ngram and vllm_suffix are vLLM's methods at the bench's K; vllm_suffix
    is refused at the edge, before any engine, where Arctic Inference is missing."""
    import importlib.util

    from specserve.cli.parser import build_parser
    from specserve.tools.bench.backends import build_backends

    real = importlib.util.find_spec
    arctic = {"installed": True}  # (CI's venv has no arctic-inference: `make arctic`)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (object() if arctic["installed"] else None) if name == "arctic_inference"
        else real(name, *a)))
    args = build_parser().parse_args(
        ["bench", "--systems", "vllm_ngram", "vllm_suffix", "--num-speculative-tokens", "3"])
    a = run.bench_args(args, "/models/t", None)
    backends = {system: make() for system, _, make in build_backends(a, None, tmp_path)}
    assert backends["vllm_ngram"].system == "vllm_ngram"
    assert backends["vllm_ngram"].speculative_config() == {
        "method": "ngram", "num_speculative_tokens": 3,
        "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    assert backends["vllm_suffix"].system == "vllm_suffix"
    assert backends["vllm_suffix"].speculative_config() == {
        "method": "suffix", "num_speculative_tokens": 3}
    assert "vllm_suffix" not in workload.DEFAULT_SYSTEMS  # runs when named

    arctic["installed"] = False
    with pytest.raises(ValueError, match="make arctic"):
        run.bench_args(args, "/models/t", None)


def test_fixed_k_drafts_every_request_with_both_drafts(tmp_path, monkeypatch):
    """--fixed-k: the specserve and specserve_adapted rows run without the K
    controller (each draft measured on every request); by default both adapt K."""
    import types

    import specserve.local
    from specserve.cli.parser import build_parser
    from specserve.tools.bench.backends import build_backends

    monkeypatch.setattr(specserve.local, "LocalSpec", lambda target, draft, **kw:
                        types.SimpleNamespace(k=kw.get("k", 0), draft=draft,
                                              adaptive=kw.get("adaptive_k", False)))
    for flags, adaptive in (([], True), (["--fixed-k"], False)):
        args = build_parser().parse_args(
            ["bench", "--systems", "specserve", "specserve_adapted", "--adapted-draft",
             "/models/v2", *flags])
        a = run.bench_args(args, "/models/t", "/models/d")
        assert a.fixed_k is not adaptive
        backends = {system: make() for system, _, make in build_backends(a, None, tmp_path)}
        assert {s: (b.spec.draft, b.spec.adaptive) for s, b in backends.items()} == {
            "specserve": ("/models/d", adaptive), "specserve_adapted": ("/models/v2", adaptive)}
