"""specserve.adapt.figures: what a draft replica answers for its pool's `adapt` figures."""

from __future__ import annotations

from specserve.adapt.buffer import AdaptBuffer
from specserve.adapt.figures import adapt_figures
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
        "rollbacks": 0}
    assert 0 < buffer.heldout_tokens < 200
    store.promote(store.record_candidate("v0", 0.3, 0.4, "swap"))
    got = adapt_figures(buffer, store.figures(), HeldOutAlpha(40, 100), HeldOutAlpha(45, 100))
    assert (got["version"], got["swaps"], got["heldout_alpha_serving"],
            got["heldout_alpha_candidate"]) == ("v1", 1, 0.4, 0.45)
    assert adapt_figures(AdaptBuffer(10, 1, 2, 0.5))["version"] is None
