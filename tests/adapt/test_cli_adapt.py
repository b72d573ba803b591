"""`specserve adapt`: the domain's prompt files, a pool's versions (status) and a
rollback, from the shell; bad input is one line and exit 2. In process: the
command starts no engine."""

from __future__ import annotations

import json

import pytest

from specserve.adapt.versions import VersionStore
from specserve.cli import main
from specserve.tools.bench.workload import parse_prompts


def config(tmp_path, enabled=True):
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "app.yaml"
    path.write_text(f"drafts: [{{name: small, model: /models/draft, adapt: "
                    f"{{enabled: {str(enabled).lower()}, versions_dir: {tmp_path / 'v'}}}}}]\n")
    return str(path)


def test_domain_writes_both_halves_as_prompt_files(tmp_path, capsys):
    assert main(["adapt", "domain", str(tmp_path / "d"), "--train", "30", "--heldout", "8"]) == 0
    train = parse_prompts((tmp_path / "d" / "train.jsonl").read_text().splitlines())
    heldout = parse_prompts((tmp_path / "d" / "heldout.jsonl").read_text().splitlines())
    assert len(train) == 30 and len(heldout) == 8
    assert all(p.system and "get_weather" in p.system for p in train + heldout)
    assert not {p.text for p in train} & {p.text for p in heldout}  # never a training request
    assert "train.jsonl (30 prompts)" in capsys.readouterr().out


def test_status_and_rollback(tmp_path, capsys):
    path = config(tmp_path)
    store = VersionStore(tmp_path / "v", source="/models/draft")
    v1 = store.record_candidate("v0", 0.3, 0.5, "swap: better", weights=None)
    store.path(v1).mkdir(exist_ok=True)
    (store.path(v1) / "config.json").write_text("{}")
    store.promote(v1, "swap: better")
    assert main(["adapt", "status", path, "--pool", "small"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["version"], status["swaps"], status["rollbacks"]) == ("v1", 1, 0)
    folders = {v["version"]: v["folder"] for v in status["versions"]}
    assert folders == {"v0": "/models/draft", "v1": str(store.path(v1))}
    assert main(["adapt", "rollback", path, "--pool", "small"]) == 0
    assert "serving v0" in capsys.readouterr().out
    assert store.figures() == {"version": "v0", "swaps": 1, "rollbacks": 1}


def test_status_names_the_shipped_drafts_folder_for_the_default_keyword(tmp_path, capsys):
    from specserve.models import default_draft_dir

    VersionStore(tmp_path / "v", source="default")  # a pool with `model: default`
    assert main(["adapt", "status", config(tmp_path), "--pool", "small"]) == 0
    (v0,) = json.loads(capsys.readouterr().out)["versions"]
    assert v0["folder"] == str(default_draft_dir())


@pytest.mark.parametrize("argv, message", [
    (["status", "{cfg}", "--pool", "other"], "no draft pool 'other'"),
    (["status", "{off}", "--pool", "small"], "does not adapt"),
    (["rollback", "{cfg}", "--pool", "small"], "no versions yet"),
    (["status", "{missing}", "--pool", "small"], "missing.yaml"),
    (["domain", "{cfg}"], "is not a folder"),
    (["domain", "{tmp}/d", "--train", "0"], "at least 1"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    names = {"cfg": config(tmp_path), "off": config(tmp_path / "off", enabled=False),
             "tmp": str(tmp_path), "missing": str(tmp_path / "missing.yaml")}
    assert main(["adapt", *[a.format(**names) for a in argv]]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
