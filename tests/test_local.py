"""LocalSpec's draft process command line (no engine started)."""

import subprocess

import pytest

from specserve.local import LocalSpec
from specserve.engine import EngineSettings


class Started(Exception):
    pass


def draft_command(monkeypatch, settings) -> list[str]:
    def popen(args, **kwargs):
        raise Started(args)

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(Started) as e:
        LocalSpec("target-model", "draft-model", k=4, settings=settings)._start_draft_process()
    return e.value.args[0]


def test_the_draft_process_gets_the_targets_kv_cache_size(monkeypatch):
    # Without it, vLLM CPU reserves 92 % of the memory for the draft and refuses
    # to start when the target (loading at the same time) took more than 8 %.
    cmd = draft_command(monkeypatch, EngineSettings(kv_cache_gib=2))
    assert cmd[cmd.index("--kv-cache-gib") + 1] == "2"
    assert cmd[cmd.index("--model") + 1] == "draft-model"
    assert "--kv-cache-gib" not in draft_command(monkeypatch, EngineSettings())
