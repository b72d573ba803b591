"""LocalSpec's draft worker: the one Serve's draft replicas run, with the target's settings (no engine started)."""

import pytest

from specserve.draft import worker
from specserve.engine import EngineSettings
from specserve.local import LocalSpec


class Started(Exception):
    pass


def draft_start(monkeypatch, settings, k=4, **kwargs) -> tuple[tuple, dict]:
    def start(*args, **kw):
        raise Started(args, kw)

    monkeypatch.setattr(worker.DraftWorker, "start", start)
    with pytest.raises(Started) as e:
        LocalSpec("target-model", "draft-model", k=k, settings=settings,
                  **kwargs)._start_draft_worker()
    return e.value.args


def test_the_draft_worker_gets_the_targets_engine_settings(monkeypatch):
    # Among them the KV cache size: without it vLLM CPU reserves 92 % of the
    # memory for the draft and refuses to start once the target took more than 8 %.
    settings = EngineSettings(kv_cache_gib=2, max_num_seqs=16, seed=7)
    args, kw = draft_start(monkeypatch, settings)
    assert args == ("draft-model", settings)
    assert kw["name"] == "draft-model/local-0"
    # the branch budget covers the K + 1 positions a verify step can reject
    assert kw["branches"].positions == 5


def test_the_draft_worker_runs_on_the_cores_the_target_leaves(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    _, kw = draft_start(monkeypatch, EngineSettings())
    assert kw["cpus"] == "2-3"  # the target has core 0 (specserve.engine.cpu_binding)


def test_an_engines_environment_is_scoped_to_its_start(monkeypatch):
    # Target and draft engines start in one process with different core lists:
    # neither may leak its settings into the other's spawn.
    from specserve.engine import scoped_env

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "user")
    monkeypatch.delenv("SPECSERVE_SCOPED_TEST", raising=False)
    import os

    with scoped_env({"VLLM_CPU_OMP_THREADS_BIND": "0", "SPECSERVE_SCOPED_TEST": "x"}):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0"
        assert os.environ["SPECSERVE_SCOPED_TEST"] == "x"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "user"
    assert "SPECSERVE_SCOPED_TEST" not in os.environ
