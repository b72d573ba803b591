"""What each target replica last reported: its engine's figures (vLLM's stat
logger, `specserve.target.engine.SpecTotals.snapshot`) and its draft sink's
book counters, kept per replica and exported labelled by it.

Owns the per-replica table and its bounds: a replica's counters stay on
/metrics for `grace_s` after it was last heard from (Serve gives a replica a
new id on every restart and scale event, so a table keyed by id only grows);
its gauges only while it is alive (a dead replica's batch size is not summed
into the pool's): in Serve's list of running target replicas when the router
has one (`set_running`), else heard from within `live_s`. Each replica's counters are its
own cumulative figures: Prometheus sums them (`sum(rate(...))`), a restart is a
new series, never a false reset. Pure: no Ray, no clock of its own.

A target replica reports after every HTTP call it serves, and the router asks
one replica (Serve's choice) at every scrape.
"""

from __future__ import annotations

import dataclasses

from specserve.acceptance import branches
from specserve.acceptance.catalogue import kind_of
from specserve.acceptance.exposition import family, histogram_family

# A replica's rows (here, and the draft replicas' in SpecStats) leave after
# GRACE_S without a report or request: Serve gives a replica a new id on every
# restart and scale event. Its gauges are shown only within LIVE_S.
GRACE_S = 600.0
LIVE_S = 60.0


@dataclasses.dataclass
class _Row:
    report: dict
    seen_at: float


class ReplicaTable:
    def __init__(self, grace_s: float = GRACE_S, live_s: float = LIVE_S):
        self.grace_s, self.live_s = grace_s, live_s
        self._rows: dict[str, _Row] = {}
        self._running: tuple[float, set[str]] | None = None  # (at, Serve's running ids)

    def set_running(self, replicas: set[str], now: float) -> None:
        """Serve's running target replicas (ids as `serve.get_replica_context().replica_tag`)."""
        self._running = (now, set(replicas))

    def running_as(self, other: "ReplicaTable") -> None:
        """Take Serve's running replicas as `other` was last told them."""
        self._running = other._running

    def update(self, report: dict, now: float) -> None:
        """report: {"replica", "model_name", "engine": {...}, "branches":
        {"model/replica": counters}} from one target replica."""
        self._rows[report["replica"]] = _Row(report, now)

    def prune(self, now: float) -> None:
        for replica, row in list(self._rows.items()):
            if now - row.seen_at > self.grace_s:
                del self._rows[replica]

    def replicas(self) -> list[str]:
        return sorted(self._rows)

    def running(self) -> list[str] | None:
        """Serve's running target replicas as last told, None if never told."""
        return None if self._running is None else sorted(self._running[1])

    def _counted(self, now: float) -> list[tuple[str, dict]]:
        return [(r, row.report) for r, row in sorted(self._rows.items())
                if now - row.seen_at <= self.grace_s]

    def _alive(self, replica: str, row: _Row, now: float) -> bool:
        if self._running is None:
            return now - row.seen_at <= self.live_s
        at, running = self._running
        # A replica that reported after Serve's list was taken is newer than it.
        return replica in running or row.seen_at > at

    def _live(self, now: float) -> list[tuple[str, dict]]:
        return [(r, row.report) for r, row in sorted(self._rows.items())
                if self._alive(r, row, now)]

    def branch_totals(self, now: float) -> dict[str, dict]:
        """The book counters per draft ("model/replica"), added up over target replicas."""
        per_draft: dict[str, list[dict]] = {}
        for _, rep in self._counted(now):
            for draft, c in rep.get("branches", {}).items():
                per_draft.setdefault(draft, []).append(c)
        return {d: branches.total(dict(enumerate(cs))) for d, cs in per_draft.items()}

    def prometheus_lines(self, now: float, kinds: dict[str, str]) -> list[str]:
        """kinds: AppConfig.draft_kinds() (the book counters' `kind` label)."""
        counted, live = self._counted(now), self._live(now)
        lines = family("specserve_target_batch_size",
                       [({"target_replica": r}, rep["engine"]["running"]) for r, rep in live])
        lines += family("specserve_target_queue_length",
                        [({"target_replica": r}, rep["engine"]["waiting"]) for r, rep in live])
        lines += _branch_lines(counted, kinds)
        lines += _vllm_lines(counted, live)
        return lines


def _branch_lines(rows: list[tuple[str, dict]], kinds: dict[str, str]) -> list[str]:
    lines: list[str] = []
    for key, name in branches.PROMETHEUS:
        samples = []
        for target, rep in rows:
            for draft, c in sorted(rep.get("branches", {}).items()):
                model, replica = branches.split(draft)
                samples.append(({"target_replica": target, "draft_model": model,
                                 "draft_replica": replica, "kind": kind_of(model, kinds)},
                                c.get(key, 0)))
        lines += family(name, samples)
    return lines


def _vllm_labels(replica: str, rep: dict) -> dict:
    return {"model_name": rep["model_name"], "engine": "0", "target_replica": replica}


# vLLM's name -> the engine snapshot's key.
VLLM_GAUGES = (("vllm:num_requests_running", "running"),
               ("vllm:num_requests_waiting", "waiting"),
               ("vllm:kv_cache_usage_perc", "kv_cache_usage"))
VLLM_COUNTERS = (("vllm:prefix_cache_queries_total", "prefix_cache_queries"),
                 ("vllm:prefix_cache_hits_total", "prefix_cache_hits"),
                 ("vllm:prompt_tokens_total", "prompt_tokens"),
                 ("vllm:generation_tokens_total", "generation_tokens"),
                 ("vllm:spec_decode_num_drafts_total", "num_drafts"),
                 ("vllm:spec_decode_num_draft_tokens_total", "draft_tokens"),
                 ("vllm:spec_decode_num_accepted_tokens_total", "accepted_tokens"))
VLLM_HISTOGRAMS = (("vllm:time_to_first_token_seconds", "ttft"),
                   ("vllm:inter_token_latency_seconds", "itl"),
                   ("vllm:request_time_per_output_token_seconds", "tpot"),
                   ("vllm:e2e_request_latency_seconds", "e2e"))


def _vllm_lines(counted: list[tuple[str, dict]], live: list[tuple[str, dict]]) -> list[str]:
    lines: list[str] = []
    for name, key in VLLM_GAUGES:
        lines += family(name, [(_vllm_labels(r, rep), rep["engine"][key]) for r, rep in live])
    for name, key in VLLM_COUNTERS:
        lines += family(name, [(_vllm_labels(r, rep), rep["engine"][key])
                               for r, rep in counted])
    # Only with speculation, as vLLM: one series per position below K.
    lines += family("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                    [({**_vllm_labels(r, rep), "position": i}, v) for r, rep in counted
                     for i, v in enumerate(rep["engine"]["accepted_per_position"])])
    for name, key in VLLM_HISTOGRAMS:
        lines += histogram_family(name, [(_vllm_labels(r, rep), rep["engine"][key])
                                         for r, rep in counted])
    return lines
