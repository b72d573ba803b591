"""specserve.adapt.figures: what a draft replica answers for its pool's `adapt` figures."""

from __future__ import annotations

from specserve.adapt.buffer import AdaptBuffer
from specserve.adapt.figures import RoundFigures, adapt_figures
from specserve.adapt.guard import HeldOutAlpha
from specserve.adapt.versions import VersionStore


def test_figures_from_the_buffer_and_the_version_store(tmp_path):
    buffer = AdaptBuffer(1000, 4, 50, heldout_share=0.5)
    for i in range(40):
        buffer.open(f"r{i}", [1, 2, 3])
        buffer.observe(f"r{i}", [1, 2, 3, 4, 5])
    store = VersionStore(tmp_path)
    assert adapt_figures(buffer, store.figures()) == {
        "version": "v0", "heldout_alpha_serving": None, "heldout_alpha_candidate": None,
        "buffer_tokens": 200, "heldout_tokens": buffer.heldout_tokens, "swaps": 0,
        "rollbacks": 0, "rounds": 0, "train_seconds": 0.0, "last_round": None}
    assert 0 < buffer.heldout_tokens < 200
    store.promote(store.record_candidate("v0", 0.3, 0.4, "swap"))
    rounds = RoundFigures(serving=HeldOutAlpha(40, 100), candidate=HeldOutAlpha(45, 100),
                          rounds=2, train_seconds=61.26, last="v2: refused: ...")
    got = adapt_figures(buffer, store.figures(), rounds)
    assert (got["version"], got["swaps"], got["heldout_alpha_serving"],
            got["heldout_alpha_candidate"], got["rounds"], got["train_seconds"],
            got["last_round"]) == ("v1", 1, 0.4, 0.45, 2, 61.3, "v2: refused: ...")
    assert adapt_figures(AdaptBuffer(10, 1, 2, 0.5))["version"] is None
    # a replica that has not loaded the promoted version yet says what it serves
    assert adapt_figures(buffer, store.figures(), rounds, loaded="v0")["version"] == "v0"
