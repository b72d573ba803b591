"""Rows, tables and the plot of a bench run, from what the backends measured.

Owns turning requests and counter differences into result rows (per system and
concurrency, per category), comparing rows (speedups, share of the ideal),
pooling rounds, and writing Markdown, JSON and the PNG. The arithmetic is in
the pure `specserve.tools.bench.stats`; nothing here starts or times a system.
"""

from __future__ import annotations

import json
from pathlib import Path

from specserve.acceptance.record import Figures, percentile
from specserve.tools.bench import stats as benchstats
from specserve.tools.bench.backends import Counters, RequestResult
from specserve.tools.bench.workload import SYSTEMS


def summarize(system: str, concurrency: int, alpha: float | None, k: int,
              results: list[RequestResult], wall_s: float, c: Counters | None,
              speculative: bool) -> dict:
    """One result row from a level's requests and counter differences."""
    n = sum(r.output_tokens for r in results)
    tpots = [r.tpot * 1e3 for r in results if r.tpot is not None]
    ttfts = [r.ttft * 1e3 for r in results if r.ttft is not None]
    row = {
        "system": system, "concurrency": concurrency, "alpha": alpha, "k": k if speculative else 0,
        "requests": len(results), "output_tokens": n, "wall_s": wall_s,
        "output_tokens_per_s": n / wall_s if wall_s > 0 else 0.0,
        "tpot_p50_ms": percentile(tpots, 50),
        "tpot_p99_ms": percentile(tpots, 99),
        "tpot_mean_ms": sum(tpots) / len(tpots) if tpots else None,
        "ttft_p50_ms": percentile(ttfts, 50),
        "acceptance_rate": None, "conditional_acceptance": None,
        "mean_accepted_length": None, "coverage": None, "tokens_per_step": 1.0,
        "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_position": [],
    }
    if speculative and c is not None:
        f = Figures.of_engine(n, c.num_drafts, c.draft_tokens, c.accepted_per_position,
                              c.draft_per_position)
        row.update({
            "draft_tokens": f.draft_tokens, "accepted_tokens": f.accepted_tokens,
            "accepted_per_position": f.accepted_per_position,
            "acceptance_rate": f.acceptance_rate if f.draft_tokens else None,
            "conditional_acceptance": f.alpha if f.alpha_trials else None,
            "mean_accepted_length": f.mean_accepted_length if f.steps_with_drafts else None,
            "coverage": f.coverage,
            "tokens_per_step": f.tokens_per_step,
        })
    return row


def category_rows(system: str, concurrency: int, alpha: float | None,
                  results: list[RequestResult]) -> list[dict]:
    """Per prompt category: per-request speed and latency, and acceptance from
    vLLM's per-request figures where the system reports them."""
    out = []
    cats = sorted({r.prompt.category for r in results})
    for cat in cats:
        rs = [r for r in results if r.prompt.category == cat]
        tpots = [r.tpot * 1e3 for r in rs if r.tpot is not None]
        ttfts = [r.ttft * 1e3 for r in rs if r.ttft is not None]
        row = {"system": system, "concurrency": concurrency, "alpha": alpha, "category": cat,
               "requests": len(rs), "output_tokens": sum(r.output_tokens for r in rs),
               "request_tokens_per_s": (sum(r.output_tokens for r in rs)
                                        / max(sum(r.end - r.start for r in rs), 1e-9)),
               "tpot_p50_ms": percentile(tpots, 50),
               "ttft_p50_ms": percentile(ttfts, 50),
               "acceptance_rate": None, "mean_accepted_length": None, "coverage": None}
        records = [r.acceptance for r in rs if r.acceptance and r.acceptance.steps_with_drafts]
        if records:
            f = Figures.of(records)
            row.update({"acceptance_rate": f.acceptance_rate if f.draft_tokens else None,
                        "mean_accepted_length": f.mean_accepted_length,
                        "coverage": f.coverage if f.steps else None})
        out.append(row)
    return out


def add_comparisons(rows: list[dict]) -> None:
    """Ratios against target_only, vllm_draft_model and (over HTTP) vllm_serve at
    the same concurrency, and for synthetic rows the ideal speedup and the share
    of it reached."""
    base = {r["concurrency"]: r for r in rows if r["system"] == "target_only"}
    vdm = {r["concurrency"]: r for r in rows if r["system"] == "vllm_draft_model"}
    serve = {r["concurrency"]: r for r in rows if r["system"] == "vllm_serve"}
    for r in rows:
        b, v = base.get(r["concurrency"]), vdm.get(r["concurrency"])
        vs = serve.get(r["concurrency"])
        r["speedup_vs_vllm_serve"] = benchstats.ratio(
            r["output_tokens_per_s"], vs and vs["output_tokens_per_s"])
        r["speedup_vs_target_only"] = benchstats.ratio(
            r["output_tokens_per_s"], b and b["output_tokens_per_s"])
        r["speedup_vs_vllm_draft_model"] = benchstats.ratio(
            r["output_tokens_per_s"], v and v["output_tokens_per_s"])
        r["verify_step_cost"] = r["ideal_speedup"] = r["share_of_ideal"] = None
        r["colocated_bound"] = r["share_of_colocated"] = None
        if r["system"] == "specserve_synthetic" and b and b.get("tpot_mean_ms") \
                and r.get("tpot_mean_ms"):
            # Time of one verify step (K drafts) over one target-only step.
            cost = r["tpot_mean_ms"] * r["tokens_per_step"] / b["tpot_mean_ms"]
            r["verify_step_cost"] = cost
            r["ideal_speedup"] = benchstats.ideal_speedup(r["alpha"], r["k"], cost)
            r["share_of_ideal"] = benchstats.ratio(r["speedup_vs_target_only"],
                                                   r["ideal_speedup"])
            r["colocated_bound"] = benchstats.colocated_bound(
                r["alpha"], r["k"], cost, (r.get("synthetic_delay_ms") or 0.0) / b["tpot_mean_ms"])
            r["share_of_colocated"] = benchstats.ratio(r["speedup_vs_target_only"],
                                                       r["colocated_bound"])


# The comparisons whose value in each round alone a pooled row also carries.
ROUND_RATIOS = ("speedup_vs_target_only", "speedup_vs_vllm_serve", "share_of_ideal")


def add_round_ratios(rows: list[dict], rounds: list[list[dict]]) -> None:
    """Each pooled row of `rows` gets, for every comparison in ROUND_RATIOS, the
    list of its value in round 1, 2, ... alone (`<key>_rounds`; None where a
    round lacks it). rounds[i] holds round i's rows, one per (system, alpha,
    concurrency); they are left as they are. One quick level varies by several
    per cent from round to round on a small machine: this shows how far, next
    to the pooled figure."""
    per: dict[tuple, dict[str, list]] = {}
    for round_rows in rounds:
        round_rows = [dict(r) for r in round_rows]
        add_comparisons(round_rows)
        for r in round_rows:
            values = per.setdefault((r["system"], r["alpha"], r["concurrency"]),
                                    {k: [] for k in ROUND_RATIOS})
            for k in ROUND_RATIOS:
                values[k].append(r.get(k))
    for r in rows:
        for k, values in per.get((r["system"], r["alpha"], r["concurrency"]), {}).items():
            r[f"{k}_rounds"] = values


def pool(rounds: list[dict]) -> dict:
    """Rows of the same (system, concurrency, alpha) from several rounds -> one
    row: sums for counts, token-weighted means for rates and latencies."""
    if len(rounds) == 1:
        return rounds[0]
    out = dict(rounds[0])
    for key in ("requests", "output_tokens", "wall_s", "draft_tokens", "accepted_tokens"):
        out[key] = sum(r[key] for r in rounds)
    if "released" in out:
        out["released"] = sum(r.get("released") or 0 for r in rounds)
    out["output_tokens_per_s"] = out["output_tokens"] / out["wall_s"]
    for key in ("tpot_p50_ms", "tpot_p99_ms", "tpot_mean_ms", "ttft_p50_ms",
                "conditional_acceptance", "mean_accepted_length", "coverage", "tokens_per_step",
                "book_alpha", "coverage_after_accepted", "coverage_after_rejected",
                "branch_hit_rate", "wait_ms_per_step"):
        vals = [(r[key], r["output_tokens"]) for r in rounds if r.get(key) is not None]
        out[key] = (sum(v * w for v, w in vals) / max(sum(w for _, w in vals), 1)
                    if vals else None)
    out["acceptance_rate"] = (out["accepted_tokens"] / out["draft_tokens"]
                              if out["draft_tokens"] else None)
    out["rounds"] = len(rounds)
    return out


TABLE = [("system", "system"), ("alpha", "α"), ("concurrency", "C"), ("k", "K"),
         ("output_tokens_per_s", "tok/s"), ("speedup_vs_target_only", "× target_only"),
         ("speedup_vs_vllm_draft_model", "× vllm_draft_model"),
         ("speedup_vs_vllm_serve", "× vllm_serve"),
         ("tpot_p50_ms", "TPOT p50 ms"), ("tpot_p99_ms", "TPOT p99 ms"),
         ("ttft_p50_ms", "TTFT p50 ms"), ("acceptance_rate", "accepted/drafted"),
         ("conditional_acceptance", "cond. acceptance"),
         ("mean_accepted_length", "mean acc. len"), ("coverage", "coverage"),
         ("ideal_speedup", "ideal ×"), ("share_of_ideal", "share of ideal"),
         ("colocated_bound", "co-located ×"), ("book_alpha", "book α"),
         ("coverage_after_accepted", "cov. after accept"),
         ("coverage_after_rejected", "cov. after reject"),
         ("branch_hit_rate", "branch hits"), ("wait_ms_per_step", "wait ms/step")]

CATEGORY_TABLE = [("system", "system"), ("alpha", "α"), ("concurrency", "C"),
                  ("category", "category"), ("request_tokens_per_s", "tok/s per request"),
                  ("tpot_p50_ms", "TPOT p50 ms"), ("acceptance_rate", "accepted/drafted"),
                  ("mean_accepted_length", "mean acc. len")]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = []
    for r in rows:
        lab = r["system"] + (f" α={r['alpha']:g}" if r["alpha"] is not None else "")
        if lab not in labels:
            labels.append(lab)
    levels = sorted({r["concurrency"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(labels) * len(levels) / 2 + 3), 4.5))
    width = 0.8 / max(len(labels), 1)
    for i, lab in enumerate(labels):
        ys = []
        for c in levels:
            match = [r for r in rows if r["concurrency"] == c and
                     r["system"] + (f" α={r['alpha']:g}" if r["alpha"] is not None else "") == lab]
            ys.append(match[0]["output_tokens_per_s"] if match else 0.0)
        ax.bar([x + i * width for x in range(len(levels))], ys, width, label=lab)
    ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(levels))])
    ax.set_xticklabels([f"concurrency {c}" for c in levels])
    ax.set_ylabel("output tokens/s")
    ax.set_title("specserve bench")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)



def markdown(report: dict) -> str:
    rows = sorted(report["results"], key=lambda r: (r["concurrency"], SYSTEMS.index(r["system"]),
                                                    r["alpha"] or 0))
    parts = [benchstats.markdown_table(rows, TABLE)]
    spread = [r for r in rows if any(r.get(f"{k}_rounds") for k in ROUND_RATIOS)]
    if spread:
        def per_round(values: list) -> str | None:
            if not any(v is not None for v in values):
                return None
            return " / ".join(benchstats.fmt(v) for v in values)

        cells = [{**r, **{k: per_round(r.get(f"{k}_rounds") or []) for k in ROUND_RATIOS}}
                 for r in spread]
        parts.append("\nEach round alone (round 1 / round 2 / ...):\n\n" + benchstats.markdown_table(
            cells, [("system", "system"), ("alpha", "α"), ("concurrency", "C"),
                    ("speedup_vs_target_only", "× target_only"),
                    ("speedup_vs_vllm_serve", "× vllm_serve"),
                    ("share_of_ideal", "share of ideal")]))
    cats = sorted(report["by_category"], key=lambda r: (r["concurrency"], r["category"],
                                                        SYSTEMS.index(r["system"]),
                                                        r["alpha"] or 0))
    parts.append("\nPer category:\n\n" + benchstats.markdown_table(cats, CATEGORY_TABLE))
    for n in report["notes"]:
        parts.append(f"\nNote: {n}")
    if report["greedy_mismatches"]:
        bad = [(m["system"], m["alpha"], m["concurrency"], m["question_id"])
               for m in report["greedy_mismatches"]]
        parts.append(f"\nGREEDY MISMATCHES against target_only (system, alpha, C, question): {bad}")
    return "\n".join(parts)



def write_outputs(report: dict, json_path: str | None, plot_path: str | None) -> Path:
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    png = Path(plot_path) if plot_path else (Path(json_path).with_suffix(".png") if json_path
                                             else Path("bench.png"))
    plot(report["results"], png)
    return png
