"""docs/kubernetes.md: every command in it is one the tests run or render —
a `make -n` recipe, a line of the GPU example's header (whose helm install the
chart tests render), or a line of the chart's notes rendered for exactly that
install; every Grafana panel it names exists."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "kubernetes.md"


def doc_commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", DOC.read_text(), re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip()]


def header_commands() -> list[str]:
    text = (REPO / "helm" / "specserve" / "examples" / "gpu-values.yaml").read_text()
    return [m.strip() for m in re.findall(r"^#   (\S.*)$", text, re.M)]


def helm_install_values(command: str) -> tuple[str, str, dict]:
    """(release, namespace, values) of a `helm install` line, as Helm reads them."""
    import helm_python as helm

    words = shlex.split(command)
    assert words[:2] == ["helm", "install"]
    release, chart_dir = words[2], words[3]
    assert (REPO / chart_dir).resolve() == REPO / "helm" / "specserve"
    namespace, values = "default", {}
    i = 4
    while i < len(words):
        flag, arg = words[i], words[i + 1]
        if flag == "-n":
            namespace = arg
        elif flag == "-f":
            values = helm.values_from_yaml((REPO / arg).read_text())
        elif flag == "--set":
            key, value = arg.split("=", 1)
            node = values
            *path, last = key.split(".")
            for k in path:
                node = node.setdefault(k, {})
            node[last] = value
        else:
            raise AssertionError(f"unexpected flag {flag}")
        i += 2
    return release, namespace, values


def test_every_command_is_run_or_rendered_by_the_tests():
    import helm_python as helm

    commands = doc_commands()
    assert commands
    (install,) = [c for c in commands if c.startswith("helm install")]
    assert install in header_commands()
    release, namespace, values = helm_install_values(install)
    chart = helm.Chart.load(str(REPO / "helm" / "specserve"))
    chart.validate_schema(values)
    rendered = chart.render(values, name=release, namespace=namespace)
    notes = next(t for p, t in rendered.items() if p.endswith("NOTES.txt"))
    note_lines = {line.strip() for line in notes.splitlines()}
    dry_run = subprocess.run(["make", "-n", "image-gpu"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
    for c in commands:
        if c.startswith("make "):
            target = c.split()[1]
            assert subprocess.run(["make", "-n", target], cwd=REPO,
                                  capture_output=True).returncode == 0, c
        elif c.startswith("docker build"):
            assert c in dry_run
        elif c.startswith("docker "):
            # tag and push the image `make image-gpu` builds, to the example's registry
            assert c in header_commands(), c
            assert "specserve:0.1.0-gpu" in dry_run
        elif c.startswith(("kubectl -n llm create secret", "helm install")):
            assert c in header_commands(), c
        else:
            assert c in note_lines, c
    # The Secret the install names is the one the create command makes.
    create = next(c for c in commands if "create secret" in c)
    assert values["apiKey"]["existingSecret"] == shlex.split(create)[6]
    assert f"--from-literal={values.get('apiKey', {}).get('secretKey', 'api-key')}=" in create


def test_the_grafana_panels_it_names_exist():
    from grafana import dashboard

    titles = {p["title"] for p in dashboard()["panels"]}
    named = set(re.findall(r"\*\*([^*]+)\*\*", DOC.read_text().split("## 4.")[1]))
    assert named and named <= titles, sorted(named - titles)
