"""Prometheus text exposition (format 0.0.4) of catalogued metrics.

Owns writing a family: its HELP and TYPE lines from the catalogue
(`specserve.acceptance.catalogue`), label values escaped as the format
requires (a draft name from gRPC metadata may hold `"`, `\\` or a newline),
and each sample's labels checked against the catalogue's. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from specserve.acceptance.catalogue import metric

Labels = Mapping[str, object]


def escape(value: object) -> str:
    """A label value as the text format writes it: \\ → \\\\, " → \\", newline → \\n."""
    return str(value).replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _number(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v) if isinstance(v, float) else str(v)


def _labels(pairs: Iterable[tuple[str, object]]) -> str:
    inner = ",".join(f'{k}="{escape(v)}"' for k, v in pairs)
    return f"{{{inner}}}" if inner else ""


def family(name: str, samples: Iterable[tuple[Labels, float]]) -> list[str]:
    """A counter's or gauge's lines: HELP, TYPE, one line per (labels, value).
    Labels must be exactly the catalogue's (in its order on the line)."""
    m = metric(name)
    if m.type == "histogram":
        raise ValueError(f"{name} is a histogram: use histogram_family")
    lines = [f"# HELP {m.name} {_help(m.help)}", f"# TYPE {m.name} {m.type}"]
    for labels, value in samples:
        lines.append(f"{m.name}{_labels(_ordered(m, labels))} {_number(value)}")
    return lines


def histogram_family(name: str, histograms: Iterable[tuple[Labels, object]]) -> list[str]:
    """A histogram's lines; each histogram has `bounds` (the catalogue's buckets),
    cumulative `counts` per bound, `total` and `sum_s`."""
    m = metric(name)
    if m.type != "histogram":
        raise ValueError(f"{name} is a {m.type}: use family")
    lines = [f"# HELP {m.name} {_help(m.help)}", f"# TYPE {m.name} histogram"]
    for labels, h in histograms:
        if tuple(h.bounds) != m.buckets:
            raise ValueError(f"{name}: buckets {tuple(h.bounds)} != the catalogue's")
        pairs = _ordered(m, labels)
        for bound, count in zip(h.bounds, h.counts):
            lines.append(f"{m.name}_bucket{_labels([*pairs, ('le', repr(float(bound)))])} {count}")
        lines += [f"{m.name}_bucket{_labels([*pairs, ('le', '+Inf')])} {h.total}",
                  f"{m.name}_sum{_labels(pairs)} {_number(float(h.sum_s))}",
                  f"{m.name}_count{_labels(pairs)} {h.total}"]
    return lines


def _ordered(m, labels: Labels) -> list[tuple[str, object]]:
    if set(labels) != set(m.labels):
        raise ValueError(f"{m.name}: labels {sorted(labels)} != the catalogue's "
                         f"{list(m.labels)}")
    return [(k, labels[k]) for k in m.labels]


def text(lines: Iterable[str]) -> str:
    return "\n".join(lines) + "\n"
