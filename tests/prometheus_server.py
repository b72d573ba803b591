"""A real Prometheus (Debian's package, `make prometheus`) scraping one
specserve app's /metrics every second, for the tests that check what a user's
Prometheus sees (test_dashboard.py, test_many_replicas.py)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

import yaml

from specserve.ports import free_port
from specserve.tools.serveproc import get

PROMETHEUS = "/usr/bin/prometheus"


def _ready(url: str) -> bool:
    try:
        return get(f"{url}/-/ready", timeout=2)[0] == 200
    except OSError:
        return False


class Prometheus:
    def __init__(self, url: str, log: Path):
        self.url, self.log = url, log

    def query(self, expr: str) -> list:
        status, body = get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert status == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def names(self) -> list[str]:
        """Every metric name Prometheus holds."""
        status, body = get(f"{self.url}/api/v1/label/__name__/values")
        assert status == 200 and body["status"] == "success", body
        return body["data"]

    def wait_for(self, expr: str, timeout: float, what: str) -> list:
        """The query's result once it is not empty."""
        deadline = time.monotonic() + timeout
        while not (result := self.query(expr)):
            assert time.monotonic() < deadline, f"not within {timeout}s: {what} ({expr})"
            time.sleep(1)
        return result


@contextlib.contextmanager
def scraping(app_url: str, workdir: Path, bearer: str | None = None):
    """A Prometheus scraping `app_url`/metrics every second (job "specserve"),
    ready; stopped after the block."""
    assert shutil.which(PROMETHEUS), "Debian's prometheus package: make prometheus"
    job = {"job_name": "specserve", "metrics_path": "/metrics",
           "static_configs": [{"targets": [urllib.parse.urlparse(app_url).netloc]}]}
    if bearer is not None:
        job["authorization"] = {"type": "Bearer", "credentials": bearer}
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [job]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run(["promtool", "check", "config", str(workdir / "prometheus.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = workdir / "prometheus.log"
    with open(log_path, "w") as log:
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={workdir / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not _ready(url):
            assert prom.poll() is None and time.monotonic() < deadline, \
                log_path.read_text()[-3000:]
            time.sleep(1)
        yield Prometheus(url, log_path)
    finally:
        prom.terminate()
        prom.wait(30)
