"""specserve.placement: what a target / draft replica asks Ray for (pure)."""

import pytest
import yaml

from specserve.config import AppConfig, DEFAULT_CONFIG_PATH, TargetConfig
from specserve.placement import (
    TargetPlacement,
    check_fits,
    draft_actor_options,
    target_placement,
)

GIB = 1 << 30


def gpu_example() -> AppConfig:
    path = DEFAULT_CONFIG_PATH.with_name("gpu-example.yaml")
    return AppConfig.model_validate(yaml.safe_load(path.read_text()))


def test_gpu_tp4_bundles_hold_every_ask_and_the_actor_takes_no_gpu():
    p = target_placement(gpu_example().target)
    bundle = {"CPU": 4, "GPU": 1, "memory": 64 * GIB, "accelerator_type:H100": 0.001}
    assert p.bundles == [bundle] * 4
    assert p.strategy == "STRICT_PACK"
    assert p.executor == "ray"
    assert p.actor == {"num_cpus": 4, "num_gpus": 0, "memory": 64 * GIB}
    assert p.worker == {"num_cpus": 0, "num_gpus": 1}  # what vLLM's Ray executor asks


def test_cpu_targets_use_mp_or_one_process_and_reserve_per_worker():
    tp2 = target_placement(TargetConfig(tensor_parallel_size=2,
                                        resources={"cpus_per_worker": 1, "memory_gib": 2}))
    assert tp2.executor == "mp" and tp2.worker == {}
    assert tp2.bundles == [{"CPU": 1, "memory": 2 * GIB}] * 2
    assert tp2.actor == {"num_cpus": 1, "num_gpus": 0, "memory": 2 * GIB}
    assert target_placement(TargetConfig()).executor == "uni"


def test_env_goes_to_the_replica_runtime_env():
    p = target_placement(TargetConfig(resources={"env": {"A": "1"}}))
    assert p.actor["runtime_env"] == {"env_vars": {"A": "1"}}


def test_check_fits_names_what_is_short():
    # The old placement: the actor asked for bundle 0's GPU and for memory no
    # bundle held; Ray could never place it.
    old = TargetPlacement(actor={"num_cpus": 4, "num_gpus": 1, "memory": 64 * GIB},
                          bundles=[{"CPU": 4, "GPU": 1}] * 4, strategy="STRICT_PACK",
                          executor="ray", worker={"num_cpus": 0, "num_gpus": 1})
    with pytest.raises(ValueError, match=r"bundle 0 holds \(.*GPU 2 > 1.*memory"):
        check_fits(old)
    short = TargetPlacement(actor={"num_cpus": 1}, bundles=[{"CPU": 1, "GPU": 1}, {"CPU": 1}],
                            strategy="STRICT_PACK", executor="ray",
                            worker={"num_cpus": 0, "num_gpus": 1})
    with pytest.raises(ValueError, match="TP worker 1 ask for more than bundle 1"):
        check_fits(short)


def test_draft_replicas_hold_their_gpu_and_accelerator_type():
    d = gpu_example().drafts[0]
    assert draft_actor_options(d.resources) == {"num_cpus": 2, "num_gpus": 1,
                                                "accelerator_type": "L4"}


def test_a_target_over_several_hosts_is_packed_not_strictly():
    t = gpu_example().target.model_copy(update={"tensor_parallel_size": 8, "hosts": 2})
    p = target_placement(TargetConfig.model_validate(t.model_dump()))
    assert p.strategy == "PACK"  # Ray Serve LLM's: the bundles spill onto a second node
    assert len(p.bundles) == 8 and all(b["GPU"] == 1 for b in p.bundles)
    assert p.executor == "ray"


@pytest.mark.parametrize("fields, message", [
    ({"tensor_parallel_size": 2, "hosts": 2}, "hosts 2 needs GPUs"),
    ({"tensor_parallel_size": 6, "hosts": 4, "resources": {"gpus_per_worker": 1}},
     "hosts 4 does not divide tensor_parallel_size 6"),
])
def test_hosts_that_cannot_be_placed_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        TargetConfig(**fields)
