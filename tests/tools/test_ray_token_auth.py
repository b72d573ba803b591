"""What the chart's `rayAuth` turns on, on this machine: KubeRay's authOptions
(mode token) set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN on every Ray
container; a Ray 2.60 head started with them refuses a job submitted to its
dashboard (Ray's Jobs API) and a driver without the token, and takes both with
it. One head node (tests/raycluster.py), clients in their own processes."""

from __future__ import annotations

import secrets
import subprocess
import sys

import pytest

from raycluster import LoopbackCluster, Node

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    cluster = LoopbackCluster([Node("head", num_cpus=1, memory_gib=2)],
                              tmp_path_factory.mktemp("ray-auth"))
    token = secrets.token_hex(32)
    # What KubeRay puts in every Ray container with authOptions.mode token.
    cluster.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    cluster.start()
    try:
        yield cluster, token
    finally:
        cluster.stop()


def _client(cluster, code: str, token: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in cluster.env.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
    if token is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def test_jobs_api_and_drivers_need_the_token(token_cluster):
    cluster, token = token_cluster
    (dashboard_port,) = [a.split("=", 1)[1] for a in cluster.procs[0].args
                         if a.startswith("--dashboard-port=")]
    submit = ("from ray.job_submission import JobSubmissionClient\n"
              f"c = JobSubmissionClient('http://127.0.0.1:{dashboard_port}')\n"
              "print('SUBMITTED', c.submit_job(entrypoint='echo hi'))\n")
    refused = _client(cluster, submit, token=None)
    assert refused.returncode != 0 and "SUBMITTED" not in refused.stdout
    assert "401" in refused.stderr or "uthenticat" in refused.stderr, refused.stderr[-2000:]
    wrong = _client(cluster, submit, token=secrets.token_hex(32))
    assert wrong.returncode != 0 and "SUBMITTED" not in wrong.stdout
    taken = _client(cluster, submit, token=token)
    assert taken.returncode == 0 and "SUBMITTED" in taken.stdout, taken.stderr[-2000:]

    driver = (f"import ray; ray.init(address='{cluster.address}', log_to_driver=False); "
              "print('NODES', len(ray.nodes()))")
    assert "NODES 1" not in _client(cluster, driver, token=None).stdout
    assert "NODES 1" in _client(cluster, driver, token=token).stdout
