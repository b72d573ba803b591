"""The chart's production controls (docs/kubernetes.md, "Before production"),
rendered by Helm's Go SDK and validated like tests/tools/test_helm.py does:

- the NetworkPolicies allow exactly the flows of a from/to/port table
  (Kubernetes' ingress semantics evaluated over the rendered policies);
- the draft stream's certificates (generated or from a Secret) reach the
  target and draft pods only, and a sink and a draft complete mutual TLS with
  the generated ones the way specserve dials (by IP, checking serverName);
- Ray token authentication is KubeRay's authOptions.
"""

from __future__ import annotations

import base64
import itertools

import pytest

from specserve.config import AppConfig
from test_helm import (RAY_PORT_PARAMS, SINK_PORT, TLS_DIR, chart_config, check_rayservice,
                       container,
                       gpu_values, groups, render, serve_app, validate_core)

# ---- NetworkPolicies --------------------------------------------------------------

NAMESPACE = "llm"
OWN = {"head", "target", "draft", "router"}


def pod_labels(rs: dict) -> dict[str, dict]:
    """component -> the pod labels the chart gives it (KubeRay adds its own)."""
    spec = rs["spec"]["rayClusterConfig"]
    out = {"head": spec["headGroupSpec"]["template"]["metadata"]["labels"]}
    for g in spec["workerGroupSpecs"]:
        labels = g["template"]["metadata"]["labels"]
        out[labels["app.kubernetes.io/component"]] = labels
    return out


def sources(rs: dict) -> dict[str, tuple | None]:
    """name -> (pod labels, namespace, namespace labels); None: outside the cluster."""
    own = {name: (labels, NAMESPACE, {"kubernetes.io/metadata.name": NAMESPACE})
           for name, labels in pod_labels(rs).items()}
    return {**own,
            "other pod": ({"app": "other"}, NAMESPACE,
                          {"kubernetes.io/metadata.name": NAMESPACE}),
            "operator": ({"app.kubernetes.io/name": "kuberay-operator"}, "kuberay-system",
                         {"kubernetes.io/metadata.name": "kuberay-system"}),
            "prometheus": ({"app.kubernetes.io/name": "prometheus"}, "monitoring",
                           {"kubernetes.io/metadata.name": "monitoring"}),
            "outside": None}


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the chart uses matchLabels only
    return selector.get("matchLabels", {}).items() <= labels.items()


def _peer_matches(peer: dict, src) -> bool:
    if src is None or "ipBlock" in peer:
        return False  # the chart's default peers are pods; an ipBlock never names a pod here
    labels, namespace, ns_labels = src
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], ns_labels):
            return False
    elif namespace != NAMESPACE:
        return False  # a podSelector alone means the policy's namespace
    return _selects(peer.get("podSelector", {}), labels)


def _port_matches(rule_ports: list | None, port: int) -> bool:
    if not rule_ports:
        return True
    return any(p.get("protocol", "TCP") == "TCP"
               and (p["port"] == port or p["port"] <= port <= p.get("endPort", p["port"]))
               for p in rule_ports)


def allowed(policies: list[dict], dst: dict, src, port: int) -> bool:
    """Kubernetes' ingress rule: a pod no policy selects takes everything; one
    that policies select takes what any of their rules allows."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], dst)]
    assert all(p["spec"]["policyTypes"] == ["Ingress"] for p in selecting)
    if not selecting:
        return True
    return any(_port_matches(rule.get("ports"), port)
               and ("from" not in rule or any(_peer_matches(peer, src) for peer in rule["from"]))
               for p in selecting for rule in p["spec"].get("ingress", []))


RAY = {6379, 10001, 8265, 8076, 8077, 8078, 8079, 52365, 8080, 10002, 15000, 19999}
PORTS = RAY | {8000, SINK_PORT, 20000, 22, 9000}
EVERYONE = {"head", "target", "draft", "router", "other pod", "operator", "prometheus", "outside"}
# The table: (from, to, ports) that are allowed; every other flow is denied.
TABLE = [
    (OWN, OWN, RAY),                        # Ray's control and data plane among its pods
    (EVERYONE, OWN, {8000}),                # the Serve port (serveFrom: [] is any source)
    ({"draft"}, {"target"}, {SINK_PORT}),   # drafts dial the target's draft sink
    ({"prometheus"}, OWN, {8080}),          # Ray's metrics agents
    ({"operator"}, {"head"}, {8265, 8000}),  # KubeRay's operator: Serve's API, proxy health
]


def flows(objs: dict) -> set[tuple[str, str, int]]:
    rs = objs["RayService"]
    policies = [o for k, o in objs.items() if k.startswith("NetworkPolicy/")]
    dsts = pod_labels(rs)
    return {(s, d, port) for (s, src), (d, dst), port
            in itertools.product(sources(rs).items(), dsts.items(), PORTS)
            if allowed(policies, dst, src, port)}


def table(rows) -> set[tuple[str, str, int]]:
    return {f for froms, tos, ports in rows for f in itertools.product(froms, tos, ports)}


def test_network_policies_allow_exactly_the_table():
    objs = render(gpu_values())
    for key in ("NetworkPolicy/ray", "NetworkPolicy/operator", "NetworkPolicy/draft-sink"):
        validate_core(objs[key])
    assert flows(objs) == table(TABLE)
    # The sink's port is the one the target binds (specserve.target.sink_port).
    _, app = serve_app(objs["RayService"])
    assert chart_config(app).target.sink_port == SINK_PORT


def test_serve_from_narrows_the_serve_port():
    values = gpu_values()
    values["networkPolicy"] = {"serveFrom": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]}
    objs = render(values)
    rows = [r for r in TABLE if r[2] != {8000}] + [({"prometheus"}, OWN, {8000})]
    assert flows(objs) == table(rows)


def test_without_network_policies_every_flow_is_open():
    values = {**gpu_values(), "networkPolicy": {"enabled": False}}
    objs = render(values)
    assert not [k for k in objs if k.startswith("NetworkPolicy")]
    assert flows(objs) == table([(EVERYONE, OWN, PORTS)])


@pytest.mark.parametrize("port, message", [
    (0, "sink_port is 0"), (8077, "one of Ray's or Serve's ports"),
    (12000, "one of Ray's or Serve's ports"), (8000, "one of Ray's or Serve's ports")])
def test_a_sink_port_the_policy_cannot_name_fails_at_render(port, message):
    import helm_python as helm

    values = gpu_values()
    values["specserve"]["target"]["sink_port"] = port
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def test_ray_ports_are_fixed_on_every_pod():
    rs = render(gpu_values())["RayService"]
    spec = rs["spec"]["rayClusterConfig"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        assert group["rayStartParams"].items() >= RAY_PORT_PARAMS.items()


# ---- the draft stream's mutual TLS ----------------------------------------------------

def _mounts_tls(group: dict) -> bool:
    mounted = any(m["mountPath"] == TLS_DIR for m in container(group)["volumeMounts"])
    has_volume = any("secret" in v for v in group["template"]["spec"]["volumes"])
    assert mounted == has_volume
    return mounted


def test_draft_tls_is_on_by_default_and_reaches_only_targets_and_drafts():
    objs = render(gpu_values())
    rs = objs["RayService"]
    check_rayservice(rs)
    secret = objs["Secret/draft-tls"]
    assert secret["type"] == "kubernetes.io/tls"
    assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert not _mounts_tls(head)
    assert not _mounts_tls(groups(rs).pop("router"))
    for name, group in groups(rs).items():
        if name == "router":
            continue
        assert _mounts_tls(group), name
        (volume,) = [v for v in group["template"]["spec"]["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == "spec-specserve-draft-tls"
    _, app = serve_app(rs)
    tls = chart_config(app).grpc_tls
    assert (tls.ca_file, tls.cert_file, tls.key_file, tls.server_name) == (
        f"{TLS_DIR}/ca.crt", f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", "draft-sink")


def test_draft_tls_from_an_existing_secret_and_off():
    values = {**gpu_values(), "draftTls": {"existingSecret": "sink-cert", "serverName": "sink"}}
    objs = render(values)
    assert "Secret/draft-tls" not in objs
    target = groups(objs["RayService"])["target"]
    (volume,) = [v for v in target["template"]["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "sink-cert"
    _, app = serve_app(objs["RayService"])
    assert chart_config(app).grpc_tls.server_name == "sink"

    objs = render({**gpu_values(), "draftTls": {"enabled": False}})
    assert "Secret/draft-tls" not in objs
    _, app = serve_app(objs["RayService"])
    assert chart_config(app).grpc_tls is None
    assert not any(_mounts_tls(g) for g in groups(objs["RayService"]).values())
    # Target-only: no stream, no certificates.
    assert "Secret/draft-tls" not in render()


def test_draft_tls_and_grpc_tls_together_are_refused():
    import helm_python as helm

    values = gpu_values()
    values["specserve"]["grpc_tls"] = {"ca_file": "/a", "cert_file": "/b", "key_file": "/c"}
    with pytest.raises(helm.HelmError, match="grpc_tls and draftTls.enabled"):
        render(values)


def test_generated_certificates_carry_mutual_tls_as_specserve_dials(tmp_path):
    """A gRPC server with the sink's credentials and a client with a draft's,
    from the rendered Secret's files, dialled by IP with serverName checked."""
    from concurrent import futures

    import grpc

    from specserve.tls import TlsFiles, channel_credentials, channel_options, server_credentials

    secret = render(gpu_values())["Secret/draft-tls"]
    for key, data in secret["data"].items():
        (tmp_path / key).write_bytes(base64.b64decode(data))
    _, app = serve_app(render(gpu_values())["RayService"])
    tls = chart_config(app).grpc_tls
    files = TlsFiles(str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt"),
                     str(tmp_path / "tls.key"), tls.server_name)

    echo = grpc.method_handlers_generic_handler("t.Echo", {
        "Say": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)})
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((echo,))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(files))
    server.start()
    try:
        with grpc.secure_channel(f"127.0.0.1:{port}", channel_credentials(files),
                                 options=channel_options(files)) as ch:
            assert ch.unary_unary("/t.Echo/Say")(b"hi", timeout=10) == b"hi"
        # A client without a certificate is refused (client auth required).
        anonymous = grpc.ssl_channel_credentials(root_certificates=files.read()[0])
        with grpc.secure_channel(f"127.0.0.1:{port}", anonymous,
                                 options=channel_options(files)) as ch:
            with pytest.raises(grpc.RpcError):
                ch.unary_unary("/t.Echo/Say")(b"hi", timeout=10)
    finally:
        server.stop(None)


# ---- Ray token authentication --------------------------------------------------------------

def test_ray_token_auth_is_kuberays_auth_options():
    rs = render(gpu_values())["RayService"]
    assert rs["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    rs = render({**gpu_values(), "rayAuth": {"existingSecret": "ray-token"}})["RayService"]
    check_rayservice(rs)
    assert rs["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token",
                                                             "secretName": "ray-token"}
    rs = render({"rayAuth": {"enabled": False}})["RayService"]
    assert "authOptions" not in rs["spec"]["rayClusterConfig"]


# ---- upgrade strategy ------------------------------------------------------------------------

INCREMENTAL_OPTIONS = {"gatewayClassName": "istio", "stepSizePercent": 25,
                       "intervalSeconds": 60, "maxSurgePercent": 25}


@pytest.mark.parametrize("strategy", [
    None,  # values.yaml's: KubeRay's own default, written out
    {"type": "None"},
    {"type": "NewClusterWithIncrementalUpgrade", "clusterUpgradeOptions": INCREMENTAL_OPTIONS},
])
def test_upgrade_strategy_reaches_the_rayservice(strategy):
    values = gpu_values()
    if strategy is not None:
        values["upgradeStrategy"] = strategy
    rs = render(values)["RayService"]
    check_rayservice(rs)
    assert rs["spec"]["upgradeStrategy"] == (strategy or {"type": "NewCluster"})


@pytest.mark.parametrize("strategy", [
    {"type": "Recreate"},  # a RayCluster strategy, not a RayService one
    {"type": "NewClusterWithIncrementalUpgrade"},  # without its options
    {"type": "NewClusterWithIncrementalUpgrade",
     "clusterUpgradeOptions": {"gatewayClassName": "istio", "stepSizePercent": 25}},
    {"type": "None", "clusterUpgradeOptions": INCREMENTAL_OPTIONS},  # options of another type
])
def test_values_schema_refuses_a_wrong_upgrade_strategy(strategy):
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError):
        render({"upgradeStrategy": strategy})


# ---- lifecycle ------------------------------------------------------------------------------

def test_a_disruption_budget_per_worker_group():
    objs = render(gpu_values())
    rs = objs["RayService"]
    labels = {g["groupName"]: g["template"]["metadata"]["labels"] for g in
              rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    labels["head"] = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"][
        "labels"]
    pdbs = {k.split("/")[1]: o for k, o in objs.items() if k.startswith("PodDisruptionBudget/")}
    assert set(pdbs) == {"target", "draft-llama-1b", "draft-llama-8b", "router"}
    for name, pdb in pdbs.items():
        validate_core(pdb)
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        selected = {g for g, lab in labels.items()
                    if pdb["spec"]["selector"]["matchLabels"].items() <= lab.items()}
        assert selected == {name}  # its own group's pods, no other group's
    assert not [k for k in render({**gpu_values(), "podDisruptionBudget": {"enabled": False}})
                if k.startswith("PodDisruptionBudget")]


def test_workers_have_probes_on_healthz_grace_shm_and_restricted_security():
    rs = render(gpu_values())["RayService"]
    serve_config, _ = serve_app(rs)
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    for name, group in groups(rs).items():
        c = container(group)
        serve = next(p for p in c["ports"] if p["name"] == "serve")
        assert serve["containerPort"] == serve_config["http_options"]["port"]
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/healthz", "port": "serve"}, name
        # The router's /healthz waits up to HEALTH_WAIT_S for a target.
        from deployments.router import HEALTH_WAIT_S

        assert c["readinessProbe"]["timeoutSeconds"] > HEALTH_WAIT_S
        spec = group["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] == 300
        (shm,) = [v for v in spec["volumes"] if v["name"] == "shm"]
        limit = {"target": {"sizeLimit": "32Gi"}, "router": {}}.get(name, {"sizeLimit": "8Gi"})
        assert shm["emptyDir"] == {"medium": "Memory", **limit}
    # The head keeps KubeRay's probes.
    assert "startupProbe" not in container(head) and "readinessProbe" not in container(head)
    assert head["template"]["spec"]["terminationGracePeriodSeconds"] == 60
    for group in [head, *groups(rs).values()]:
        spec, c = group["template"]["spec"], container(group)
        # Kubernetes' restricted Pod Security level, as the Ray image's user ray (1000:100).
        assert spec["securityContext"] == {
            "runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100,
            "seccompProfile": {"type": "RuntimeDefault"}}
        assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                        "capabilities": {"drop": ["ALL"]}}
        assert not any("hostPath" in v for v in spec["volumes"])
    # KubeRay's autoscaler sidecar in the head pod too.
    assert rs["spec"]["rayClusterConfig"]["autoscalerOptions"]["securityContext"] == \
        container(head)["securityContext"]


def test_ray_image_runs_as_the_user_the_security_context_names():
    """runAsUser 1000 / fsGroup 100 is the Ray base image's `ray` user, which
    the Dockerfiles install as (COPY --chown=ray:users)."""
    from test_helm import REPO

    for name in ("Dockerfile.cpu", "Dockerfile.gpu"):
        text = (REPO / name).read_text()
        assert "ARG BASE_IMAGE=rayproject/ray:" in text and "--chown=ray:users" in text
        assert "USER root" not in text


def test_idle_timeouts_per_group_need_autoscaler_v2():
    import helm_python as helm

    rs = render(gpu_values())["RayService"]
    check_rayservice(rs)
    assert rs["spec"]["rayClusterConfig"]["autoscalerOptions"]["version"] == "v2"
    assert {n: g.get("idleTimeoutSeconds") for n, g in groups(rs).items()} == {
        "target": 1800, "draft-llama-1b": 600, "draft-llama-8b": 600, "router": None}
    values = gpu_values()
    values["autoscaler"] = {"version": None}
    with pytest.raises(helm.HelmError, match="idleTimeoutSeconds needs KubeRay's autoscaler v2"):
        render(values)
    assert "idleTimeoutSeconds" not in groups(render()["RayService"])["target"]


def test_the_head_pulls_the_cpu_image_and_the_example_is_not_public():
    objs = render(gpu_values())
    rs = objs["RayService"]
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert container(head)["image"] == "registry.example.com/specserve:0.1.0-cpu"
    for name, group in groups(rs).items():  # the router's pods hold no GPU either
        flavor = "cpu" if name == "router" else "gpu"
        assert container(group)["image"] == f"registry.example.com/specserve:0.1.0-{flavor}"
    # An explicit tag is every pod's image.
    rs = render({**gpu_values(), "image": {"repository": "r/s", "tag": "x"}})["RayService"]
    assert container(rs["spec"]["rayClusterConfig"]["headGroupSpec"])["image"] == "r/s:x"
    assert rs["spec"]["serveService"]["spec"]["type"] == "ClusterIP"


def test_incremental_upgrade_without_the_autoscaler_fails_at_render():
    import helm_python as helm

    values = {**gpu_values(), "autoscaler": {"enabled": False},
              "upgradeStrategy": {"type": "NewClusterWithIncrementalUpgrade",
                                  "clusterUpgradeOptions": INCREMENTAL_OPTIONS}}
    with pytest.raises(helm.HelmError, match="needs KubeRay's autoscaler"):
        render(values)


# ---- a target larger than one node ------------------------------------------------------------

def test_a_target_over_two_hosts_is_numofhosts_pods_each_with_its_share():
    from specserve.placement import target_placement

    values = gpu_values()
    values["specserve"]["target"].update(tensor_parallel_size=8, hosts=2)
    rs = render(values)["RayService"]
    check_rayservice(rs)
    target = groups(rs)["target"]
    assert target["numOfHosts"] == 2  # KubeRay creates and removes the two pods together
    assert container(target)["resources"]["limits"]["nvidia.com/gpu"] == 4  # 8 / 2
    _, app = serve_app(rs)
    placement = target_placement(chart_config(app).target)
    assert placement.strategy == "PACK" and len(placement.bundles) == 8
    # One host's share of the bundles fits one pod; the default stays one pod per replica.
    assert sum(b["GPU"] for b in placement.bundles) / 2 == 4
    assert groups(render(gpu_values())["RayService"])["target"]["numOfHosts"] == 1


@pytest.mark.parametrize("target, gpus, message", [
    ({"tensor_parallel_size": 8, "hosts": 2}, 3,
     r"workerGroups.target.gpus 3 is less than the 4 GPUs one replica needs on a pod "
     r"\(tensor_parallel_size 8 / hosts 2 x gpus_per_worker 1\)"),
    ({"tensor_parallel_size": 6, "hosts": 4}, None, "hosts 4 does not divide "
                                                    "tensor_parallel_size 6"),
    ({"tensor_parallel_size": 2, "hosts": 2, "resources": {"cpus_per_worker": 1}}, None,
     r"hosts 2 needs GPUs"),
])
def test_hosts_that_cannot_hold_the_target_fail_at_render(target, gpus, message):
    import helm_python as helm

    values = gpu_values()
    values["specserve"]["target"].update(target)
    if gpus is not None:
        values["workerGroups"]["target"]["gpus"] = gpus
    with pytest.raises(helm.HelmError, match=message):
        render(values)
