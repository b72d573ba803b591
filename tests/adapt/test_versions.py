"""specserve.adapt.versions: the manifest, candidates, promotion, rollback, atomic writes."""

from __future__ import annotations

import json
import os

import pytest

from specserve.adapt.versions import MANIFEST, VersionError, VersionStore


def test_a_new_store_serves_the_shipped_draft(tmp_path):
    store = VersionStore(tmp_path / "pool", source="/models/draft")
    assert store.current() == "v0"
    assert store.path("v0").is_dir()
    [v0] = store.versions()
    assert v0["source"] == "/models/draft" and v0["reason"] == "shipped"
    assert store.figures() == {"version": "v0", "swaps": 0, "rollbacks": 0}
    # Opening it again keeps what is there.
    assert VersionStore(tmp_path / "pool", source="other").versions() == [v0]


def test_candidates_promotion_and_rollback(tmp_path):
    store = VersionStore(tmp_path)
    weights = tmp_path / "incoming"
    weights.mkdir()
    (weights / "model.safetensors").write_text("w")
    v1 = store.record_candidate("v0", 0.33, 0.45, "swap: ...", weights=weights, at=5.0)
    assert v1 == "v1" and (store.path(v1) / "model.safetensors").read_text() == "w"
    assert not weights.exists()
    assert store.current() == "v0"  # recorded, not serving
    entry = store.versions()[-1]
    assert (entry["parent"], entry["alpha_before"], entry["alpha_after"], entry["at"],
            entry["state"]) == ("v0", 0.33, 0.45, 5.0, "candidate")
    store.promote(v1, "guard")
    v2 = store.record_candidate(v1, 0.45, 0.30, "refused: ...")
    assert store.path(v2).is_dir() and store.current() == "v1"
    v3 = store.record_candidate(v1, 0.45, 0.50, "swap: ...")
    store.promote(v3)
    assert store.figures() == {"version": "v3", "swaps": 2, "rollbacks": 0}
    assert store.rollback("operator") == "v1"
    assert store.rollback() == "v0"
    assert store.figures() == {"version": "v0", "swaps": 2, "rollbacks": 2}
    states = {e["version"]: e["state"] for e in store.versions()}
    assert states == {"v0": "promoted", "v1": "rolled back", "v2": "candidate",
                      "v3": "rolled back"}
    with pytest.raises(VersionError, match="nothing to roll back to: v0"):
        store.rollback()


def test_bad_versions_are_refused_with_what_exists(tmp_path):
    store = VersionStore(tmp_path)
    with pytest.raises(VersionError, match="no version 'v9'; the store holds v0"):
        store.promote("v9")
    with pytest.raises(VersionError, match="already the serving version"):
        store.promote("v0")
    with pytest.raises(VersionError):
        store.record_candidate("v7", None, None, "")
    # A folder a crash left behind is not reused.
    (tmp_path / "v1").mkdir()
    assert store.record_candidate("v0", None, None, "") == "v2"


def test_manifest_writes_are_atomic(tmp_path, monkeypatch):
    store = VersionStore(tmp_path)
    before = (tmp_path / MANIFEST).read_text()

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.record_candidate("v0", 0.1, 0.2, "x")
    monkeypatch.undo()
    # The manifest is the old one, whole.
    assert (tmp_path / MANIFEST).read_text() == before
    assert json.loads(before)["current"] == "v0"
    store.promote(store.record_candidate("v0", 0.1, 0.2, "x"))
    assert VersionStore(tmp_path).current() == store.current() != "v0"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
