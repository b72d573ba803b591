"""The draft weights' versions on disk: which one serves, where each came from.

Owns a directory (`AdaptConfig.versions_dir`, one per draft pool) holding a
folder per version and `manifest.json`, the record of them all:

    v0/  v1/  v2/ ...  manifest.json

- `v0` is the shipped draft (the pool's own model folder, named in the
  manifest as its `source`; its folder stays empty);
- every later version is a candidate some training made, recorded with its
  parent, the held-out alpha of the serving weights when it was judged
  (`alpha_before`) and its own (`alpha_after`), the time, and the reason (the
  guard's, `specserve.adapt.guard.judge`);
- `promote` makes a version the serving one; `rollback` goes back to the
  version promoted before the current one. The promotions form a stack in the
  manifest (`promoted`, v0 at the bottom), so a rollback always lands on
  weights that served before.

Every change rewrites the manifest atomically (a temporary file, fsync, then
os.replace): a crash leaves the old manifest or the new one, never half of
one. Every call reads the manifest again, so a store opened by another
process (a replica of the same pool) sees its changes. Never does: train,
judge, or load weights into an engine.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

MANIFEST = "manifest.json"
SHIPPED = "v0"


class VersionError(ValueError):
    """A version that does not exist, or a rollback with nothing to go back to."""


class VersionStore:
    def __init__(self, root: str | Path, source: str | None = None):
        """Open the store at `root`, creating it (with v0, the shipped draft
        `source`) when it holds no manifest yet."""
        self.root = Path(root)
        if not (self.root / MANIFEST).is_file():
            (self.root / SHIPPED).mkdir(parents=True, exist_ok=True)
            self._write({"current": SHIPPED, "promoted": [SHIPPED], "swaps": 0,
                         "rollbacks": 0,
                         "versions": [{"version": SHIPPED, "parent": None, "source": source,
                                       "alpha_before": None, "alpha_after": None,
                                       "at": time.time(), "reason": "shipped",
                                       "state": "promoted"}]})

    # ---- reading ---------------------------------------------------------------------

    def current(self) -> str:
        """The version serving now."""
        return self._read()["current"]

    def path(self, version: str) -> Path:
        """The folder of `version`'s weights (v0's is empty: its weights are `source`)."""
        self._entry(self._read(), version)
        return self.root / version

    def versions(self) -> list[dict]:
        """Every version's record, oldest first."""
        return self._read()["versions"]

    def figures(self) -> dict:
        """{version, swaps, rollbacks}: for the pool's `adapt` figures."""
        m = self._read()
        return {"version": m["current"], "swaps": m["swaps"], "rollbacks": m["rollbacks"]}

    # ---- changing --------------------------------------------------------------------

    def record_candidate(self, parent: str, alpha_before: float | None,
                         alpha_after: float | None, reason: str,
                         weights: str | Path | None = None, at: float | None = None) -> str:
        """Record a new version trained from `parent`; returns its name. weights:
        a folder to move in as the version's folder (on the same filesystem as
        the store); None: an empty folder the caller fills."""
        m = self._read()
        self._entry(m, parent)
        n = 1 + max(int(e["version"][1:]) for e in m["versions"])
        while (self.root / f"v{n}").exists():  # a folder a crash left behind
            n += 1
        version = f"v{n}"
        if weights is not None:
            os.replace(weights, self.root / version)
        else:
            (self.root / version).mkdir()
        m["versions"].append({"version": version, "parent": parent, "source": None,
                              "alpha_before": alpha_before, "alpha_after": alpha_after,
                              "at": time.time() if at is None else at, "reason": reason,
                              "state": "candidate"})
        self._write(m)
        return version

    def promote(self, version: str, reason: str = "") -> None:
        """Make `version` the serving one (a swap)."""
        m = self._read()
        entry = self._entry(m, version)
        if version == m["current"]:
            raise VersionError(f"{version} is already the serving version")
        m["promoted"].append(version)
        m["current"] = version
        m["swaps"] += 1
        entry["state"] = "promoted"
        entry["promoted_at"], entry["promoted_reason"] = time.time(), reason
        self._write(m)

    def rollback(self, reason: str = "") -> str:
        """Serve the version promoted before the current one again; returns it."""
        m = self._read()
        if len(m["promoted"]) < 2:
            raise VersionError(f"nothing to roll back to: {m['current']} is the first "
                               "version that served")
        left = m["promoted"].pop()
        entry = self._entry(m, left)
        entry["state"] = "rolled back"
        entry["rolled_back_at"], entry["rolled_back_reason"] = time.time(), reason
        m["current"] = m["promoted"][-1]
        m["rollbacks"] += 1
        self._write(m)
        return m["current"]

    # ---- the manifest ----------------------------------------------------------------

    @staticmethod
    def _entry(m: dict, version: str) -> dict:
        for e in m["versions"]:
            if e["version"] == version:
                return e
        known = ", ".join(e["version"] for e in m["versions"])
        raise VersionError(f"no version {version!r}; the store holds {known}")

    def _read(self) -> dict:
        return json.loads((self.root / MANIFEST).read_text())

    def _write(self, m: dict) -> None:
        tmp = self.root / f".{MANIFEST}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(m, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.root / MANIFEST)
        finally:
            tmp.unlink(missing_ok=True)  # gone after a replace; a failed write's leftover
