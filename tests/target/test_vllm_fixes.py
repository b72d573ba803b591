"""The vLLM work-arounds in specserve.target.vllm_fixes do what they say."""

import pytest
import torch

from specserve.target import vllm_fixes


def test_expand_kernel_fills_float_outputs_per_request():
    out = torch.empty(5)
    vllm_fixes.expand_kernel(out, torch.tensor([0.7, -1.0, 2.0]),
                             torch.tensor([2, 2, 5], dtype=torch.int32), -1, 1)
    assert out.tolist() == [0.7, 0.7, 2.0, 2.0, 2.0] or torch.allclose(
        out, torch.tensor([0.7, 0.7, 2.0, 2.0, 2.0]))


def test_expand_kernel_through_vllm_dispatch_after_apply():
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    current_platform.register_triton_kernel_overrides()  # what a vLLM worker does
    vllm_fixes.apply()
    temps = expand_batch_to_tokens(torch.tensor([0.5, -1.0, 1.5]),
                                   torch.tensor([1, 3, 4], dtype=torch.int32), 4,
                                   replace_from=-1, replace_to=1)
    assert torch.allclose(temps, torch.tensor([0.5, 1.0, 1.0, 1.5]))
    top_k = expand_batch_to_tokens(torch.tensor([5, 0], dtype=torch.int32),
                                   torch.tensor([2, 3], dtype=torch.int32), 3)
    assert top_k.tolist() == [5, 5, 0]


def test_top_k_on_an_empty_batch_needs_the_fix_and_passes_through_with_it():
    """A step with no drafted position filters a [0, vocab] tensor (fix 2)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    empty, k = torch.empty(0, 10), torch.empty(0, dtype=torch.int32)
    vllm_fixes.apply()
    original = vllm_fixes._top_k_only
    assert original is not None, "the fix was not installed on this CPU"
    # Still broken in the installed vLLM: when this fails, drop fix 2.
    with pytest.raises(RuntimeError, match="numel"):
        original(empty, k)
    assert topk_topp_sampler.apply_top_k_top_p(empty, k, None).shape == (0, 10)
    # A non-empty batch is vLLM's own result.
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [1.0, 0.0, 2.0, 3.0]])
    out = topk_topp_sampler.apply_top_k_top_p(logits.clone(), torch.tensor([1, 4], dtype=torch.int32),
                                             None)
    assert torch.isinf(out[0]).tolist() == [True, False, True, True]
    assert torch.equal(out[1], logits[1])
