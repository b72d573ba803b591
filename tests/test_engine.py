"""specserve.engine.cpu_binding: the OpenMP core lists of target and draft engines."""

from specserve.engine import cpu_binding


def test_without_a_model_draft_the_target_takes_every_core():
    assert cpu_binding(1, 2) == ("0-1", None)
    assert cpu_binding(1, 1) == ("0", None)
    assert cpu_binding(2, 4) == ("0-1|2-3", None)
    assert cpu_binding(2, 2) == ("0|1", None)
    assert cpu_binding(4, 2) == (None, None)  # more ranks than cores: vLLM's own binding


def test_a_model_draft_gets_cores_the_target_leaves():
    assert cpu_binding(1, 2, model_draft=True) == ("0", "1")
    assert cpu_binding(1, 4, model_draft=True) == ("0", "2-3")
    assert cpu_binding(2, 4, model_draft=True) == ("0|1", "0-3")
    assert cpu_binding(1, 1, model_draft=True) == (None, None)
