"""Drafts that learn the traffic they serve (issue 29): collection, the guard, versions.

- `buffer`: `AdaptBuffer`, the bounded (context, target continuation) examples a
  draft replica keeps from the verified tokens it already receives, with a
  held-out slice chosen by request id and never trained on;
- `guard`: whether a candidate's held-out alpha beats the serving weights' by
  the margin (`judge`), with the reason either way;
- `versions`: the draft weights' versions on disk and the manifest that says
  which one serves (`VersionStore`);
- `figures`: a replica's `adapt` figures for its pool's row on /v1/spec/stats.

The draft runner feeds the buffer (specserve/draft/runner.py); the draft
replica holds the buffer and the store (deployments/draft.py).

Settings: `specserve.config.AdaptConfig` (`drafts[].adapt`, off by default).
"""
