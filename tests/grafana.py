"""The Grafana dashboard's PromQL: which metric names its panels query (shared by
the chart test and the live /metrics and Prometheus tests)."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "helm" / "specserve" / "dashboards" / "specserve.json"


PROMQL_FUNCTIONS = {"sum", "max", "min", "avg", "count", "rate", "irate", "increase", "changes",
                    "histogram_quantile", "clamp_min", "clamp_max", "topk", "bottomk"}
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset"}


def promql_metrics(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, function names) an expression uses."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\b(group_left|group_right)\b", " ", e)
    metrics, functions = set(), set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = m.group()
        if e[m.end():].lstrip().startswith("("):
            functions.add(word)
        elif word not in PROMQL_WORDS:
            metrics.add(word)
    return metrics, functions


GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def promql_grouping(expr: str) -> list[set[str]]:
    """The label sets of an expression's by / without / on / ignoring clauses."""
    return [{x.strip() for x in g.split(",") if x.strip()} for g in GROUPING.findall(expr)]


def promql_labels(expr: str) -> set[str]:
    """Every label an expression names: in its clauses and its label matchers."""
    labels = set().union(*promql_grouping(expr))
    for matchers in re.findall(r"\{([^}]*)\}", re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)):
        labels |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    return labels


def legend_labels(legend: str) -> set[str]:
    return set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend or ""))


def grafana_targets() -> list[dict]:
    """Every panel target (expr, legendFormat) of the dashboard."""
    return [t for p in dashboard()["panels"] for t in p["targets"]]


@lru_cache(maxsize=1)
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def grafana_expressions() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]


def grafana_metric_names() -> set[str]:
    names = set()
    for expr in grafana_expressions():
        names |= promql_metrics(expr)[0]
    return names


def exposed_names(text: str) -> set[str]:
    """The series names a Prometheus text exposition defines (a histogram
    `x` defines x_bucket, x_sum and x_count)."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)", text, re.M):
        names |= ({f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram"
                  else {name})
    return names


def as_promql(expr: str) -> str:
    """A dashboard expression as Grafana sends it: its variables substituted
    (all jobs and models; $__rate_interval at least 4 scrape intervals)."""
    return (expr.replace("$__rate_interval", "30s").replace("$job", ".+")
            .replace("$model", ".+"))
