"""specserve.config.fit: a config against its models and a local cluster. Pure."""

from __future__ import annotations

from specserve.config import AppConfig
from specserve.config.fit import (
    context_problem,
    deploy_asks,
    describe_ask,
    describe_free,
    local_fit_problem,
)


def test_max_model_len_against_the_models_context():
    assert context_problem("target", None, "/m", 512) is None  # the model's own
    assert context_problem("target", 512, "/m", 512) is None
    assert context_problem("target", 2048, "/m", None) is None  # unknown: vLLM decides
    assert context_problem("drafts[0] (d)", 2048, "/m", 512) == (
        "drafts[0] (d).engine.max_model_len 2048 is more than the 512 tokens /m takes (its "
        "config.json); lower it, or set it to null for the model's own")


def test_the_embedded_defaults_fit_their_local_cluster():
    cfg = AppConfig.embedded_default()
    assert [(a.deployment, a.replicas, a.total()) for a in deploy_asks(cfg)] == [
        ("target", 1, {"CPU": 2.0}), ("draft-suffix", 1, {"CPU": 0.0})]
    assert local_fit_problem(cfg, cfg.ray.num_cpus) is None
    pair = AppConfig.embedded_default(model_draft=True)
    assert [(a.deployment, a.replicas, a.total()) for a in deploy_asks(pair)] == [
        ("target", 1, {"CPU": 1.0}), ("draft-smollm2-distill", 1, {"CPU": 1.0})]
    assert local_fit_problem(pair, pair.ray.num_cpus) is None


def test_two_draft_pools_on_the_default_share_the_cores_or_do_not_fit():
    base = AppConfig.embedded_default(model_draft=True)  # what --draft starts from
    copied = base.with_overrides(drafts=["/m/a", "/m/b"])
    assert local_fit_problem(copied, 2) == (
        "the deployments ask 3 CPUs (target 1, draft-a 1, draft-b 1) of a local Ray cluster "
        "of 2; lower resources.cpus_per_worker or replicas, or raise ray.num_cpus")
    shared = base.with_overrides(drafts=["/m/a", "/m/b"], share_draft_cpus=True)
    assert [d.resources.cpus_per_worker for d in shared.drafts] == [0.5, 0.5]
    assert local_fit_problem(shared, 2) is None
    assert local_fit_problem(copied, 3) is None


def test_asks_count_tp_bundles_and_the_replicas_started():
    cfg = AppConfig.from_dict({
        "target": {"tensor_parallel_size": 2, "resources": {"cpus_per_worker": 1.5},
                   "replicas": {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2}},
        "drafts": [{"name": "d", "model": "/m/d",
                    "resources": {"cpus_per_worker": 0.25, "memory_gib": 2},
                    "replicas": {"min_replicas": 3, "max_replicas": 3}}]})
    target, draft = deploy_asks(cfg)
    assert target.replicas == 2 and target.per_replica() == {"CPU": 3.0}
    assert target.total() == {"CPU": 6.0}
    assert draft.replicas == 3 and draft.total() == {"CPU": 0.75, "memory": 6 * (1 << 30)}
    assert local_fit_problem(cfg, 7) is None
    assert "ask 6.75 CPUs (target 6, draft-d 0.75)" in local_fit_problem(cfg, 6)
    assert describe_ask(target) == "each replica asks CPU 3 in bundles [CPU 1.5], [CPU 1.5]"
    assert describe_ask(draft) == "each replica asks CPU 0.25, memory 2.0 GiB"


def test_free_resources_are_described_per_node():
    free = {"10.0.0.2": {"CPU": 0.0, "memory": 3 * (1 << 30), "node:10.0.0.2": 1.0},
            "10.0.0.1": {"CPU": 1.5, "GPU": 1.0}}
    assert describe_free(free) == ("free: node 10.0.0.1: CPU 1.5, GPU 1; "
                                   "node 10.0.0.2: CPU 0, memory 3.0 GiB")
    assert describe_free({}) == "free: no live node"
