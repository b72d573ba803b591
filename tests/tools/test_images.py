"""The container images (Dockerfile.cpu, Dockerfile.gpu): they install
specserve with scripts/install.sh, the script `make install` runs (so every
`make test` exercises the images' install step), and the Helm chart's default
image is the one they build (`make image-cpu` / `make image-gpu`)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL = "scripts/install.sh"


def run_steps(dockerfile: Path) -> list[str]:
    """The RUN instructions of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [line.split(None, 1)[1] for line in text.splitlines()
            if line.strip().upper().startswith("RUN ")]


def make_dry_run(*targets: str) -> str:
    """What make would run, as when called from a shell: under `make test` the
    parent's MAKEFLAGS/MAKELEVEL would add "Entering directory" lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "--no-print-directory", "-n", "-B", *targets], cwd=REPO,
                          env=env, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_dockerfile_installs_with_the_make_install_script(variant):
    steps = run_steps(REPO / f"Dockerfile.{variant}")
    installs = [s for s in steps if INSTALL in s]
    assert len(installs) == 1, steps
    words = shlex.split(installs[0].split("&&")[0])
    assert words[:3] == [INSTALL, "python", variant]
    # Nothing else installs Python packages behind the script's back.
    for s in steps:
        assert not re.search(r"\bpip3?\s+install\b|\buv\s+pip\b", s), s
    assert f"FROM ${{BASE_IMAGE}}" in (REPO / f"Dockerfile.{variant}").read_text()
    assert re.search(rf"ARG BASE_IMAGE=rayproject/ray:2\.60\.0-py311-",
                     (REPO / f"Dockerfile.{variant}").read_text())


def test_make_install_runs_the_same_script():
    lines = make_dry_run(".venv/.installed").splitlines()
    assert any(shlex.split(line)[:3] == [INSTALL, ".venv/bin/python", "cpu"] for line in lines)
    assert not any(re.search(r"\bpip\s+install\b", line) for line in lines), lines


def test_install_script_refuses_an_unknown_variant():
    out = subprocess.run(["bash", INSTALL, "python3", "tpu"], cwd=REPO, capture_output=True,
                         text=True)
    assert out.returncode == 2 and "variant must be cpu or gpu" in out.stderr


def test_make_image_targets_build_the_charts_default_images():
    from test_helm import gpu_values, render

    built = {}
    for line in make_dry_run("image-cpu", "image-gpu").splitlines():
        words = shlex.split(line)
        assert words[:2] == ["docker", "build"]
        built[words[words.index("-f") + 1]] = words[words.index("-t") + 1]
    assert set(built) == {"Dockerfile.cpu", "Dockerfile.gpu"}

    def images(values):
        spec = render(values)["RayService"]["spec"]["rayClusterConfig"]
        pods = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
        return {c["image"] for p in pods for c in p["template"]["spec"]["containers"]}

    assert images(None) == {built["Dockerfile.cpu"]}
    # The GPU example pulls both from the registry they were pushed to: the
    # GPU image on the GPU pools, the CPU image on the head (it holds no GPU).
    tags = {d: built[d].split(":", 1)[1] for d in built}
    assert images(gpu_values()) == {f"registry.example.com/specserve:{t}" for t in tags.values()}
    # The documented names: what values.yaml says the Dockerfiles build.
    values_text = (REPO / "helm" / "specserve" / "values.yaml").read_text()
    for dockerfile, image in built.items():
        assert f"docker build -f {dockerfile} -t {image} ." in values_text
        assert f"docker build -f {dockerfile} -t {image} ." in (REPO / dockerfile).read_text()
