"""specserve.config: the shipped YAML files, defaults, every validator's error
message, CLI overrides and the YAML round trip. Pure: no engines, no Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.config import (
    DEFAULT_CONFIG_PATH,
    AppConfig,
    Autoscaling,
    ConfigError,
    DraftConfig,
    SpeculationConfig,
    lookahead_problem,
)

REPO = Path(__file__).resolve().parents[2]
GPU_EXAMPLE = REPO / "cluster" / "gpu-example.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def load_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        AppConfig.from_yaml(write(tmp_path, text))
    return str(info.value)


# ---- the shipped files ---------------------------------------------------------


def test_embedded_default_loads():
    cfg = AppConfig.embedded_default()
    assert DEFAULT_CONFIG_PATH == REPO / "cluster" / "default.yaml"
    assert cfg.target.model is None
    assert cfg.target.served_name() == "SmolLM2-135M-Instruct"
    assert cfg.target.tensor_parallel_size == 1
    assert cfg.target.resources.env == {}  # unpinned: every core (engine.cpu_binding)
    assert cfg.target.resources.cpus_per_worker == 2
    assert cfg.target.engine.kv_cache_gib == 2
    assert cfg.target.engine.max_model_len == 2048
    assert [(d.name, d.kind, d.model) for d in cfg.drafts] == [("suffix", "suffix", None)]
    assert cfg.drafts[0].resources.cpus_per_worker == 0 and cfg.drafts[0].suffix.share
    assert cfg.speculation.num_speculative_tokens == 4
    assert cfg.lookahead_tokens() == 9
    assert (cfg.http.host, cfg.http.port) == ("127.0.0.1", 8000)
    assert cfg.ray.num_cpus == 2 and cfg.ray.address is None


def test_model_draft_pair_loads():
    cfg = AppConfig.embedded_default(model_draft=True)
    assert cfg.target.served_name() == "SmolLM2-135M-Instruct"
    assert cfg.target.resources.env == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert cfg.target.resources.cpus_per_worker == 1
    assert [(d.name, d.kind, d.model) for d in cfg.drafts] == [
        ("smollm2-distill", "model", "default")]
    assert cfg.drafts[0].resources.cpus_per_worker == 1
    assert cfg.speculation == AppConfig.embedded_default().speculation


def test_gpu_example_loads():
    cfg = AppConfig.from_yaml(GPU_EXAMPLE)
    assert cfg.target.tensor_parallel_size == 4
    assert cfg.target.resources.accelerator_type == "H100"
    assert cfg.target.resources.gpus_per_worker == 1
    assert [d.name for d in cfg.drafts] == ["llama-1b", "llama-8b"]
    assert all(d.resources.accelerator_type == "L4" for d in cfg.drafts)
    assert cfg.speculation.num_speculative_tokens == 4
    assert cfg.lookahead_tokens() == 9


# ---- defaults ------------------------------------------------------------------


def test_defaults():
    cfg = AppConfig()
    assert cfg == AppConfig.from_dict({}) == AppConfig.from_dict(None)
    assert cfg.target.replicas == Autoscaling(min_replicas=1, max_replicas=1)
    assert cfg.target.replicas.upscale_delay_s == 30
    assert cfg.target.replicas.downscale_delay_s == 300
    assert cfg.target.resources.cpus_per_worker == 1
    assert cfg.target.resources.gpus_per_worker == 0
    assert cfg.target.engine.dtype == "auto"
    assert cfg.target.engine.max_num_seqs == 64
    assert cfg.target.engine.enforce_eager is True
    assert cfg.target.sink_port == 0
    assert cfg.target.max_ongoing_requests == 64
    assert cfg.http.max_body_bytes == 4 * 1024 * 1024
    assert cfg.http.api_key is None
    assert DraftConfig(name="d", model="/m").max_ongoing_requests == 256
    assert DraftConfig(name="d", model="/m").adapt.enabled is False  # off by default


def test_every_field_is_described():
    """The descriptions are the reference of every key (cluster/*.yaml, Helm values)."""
    def missing(model, path):
        for name, field in model.model_fields.items():
            if not (field.description or "").strip():
                yield f"{path}{name}"
            for sub in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(sub, type) and hasattr(sub, "model_fields"):
                    yield from missing(sub, f"{path}{name}.")
    assert list(missing(AppConfig, "")) == []


def test_adapt_is_off_in_every_shipped_config_but_online_adapt():
    shipped = sorted((REPO / "cluster").glob("*.yaml"))
    assert {DEFAULT_CONFIG_PATH.name, GPU_EXAMPLE.name} <= {p.name for p in shipped}
    for path in shipped:
        adapting = [d.name for d in AppConfig.from_yaml(path).drafts if d.adapt.enabled]
        assert adapting == (["smollm2-distill"] if path.name == "online-adapt.yaml" else []), path
    (pool,) = AppConfig.from_yaml(REPO / "cluster" / "online-adapt.yaml").drafts
    # a swap can show within 30 minutes of traffic: two rounds' schedule
    assert 2 * pool.adapt.train_every_minutes <= 30 and pool.model == "default"


def test_collect_gaps_of_the_adapting_pools():
    config = AppConfig.from_dict({"drafts": [
        {"name": "a", "model": "/m", "adapt": {"enabled": True, "collect_share": 0.25}},
        {"name": "b", "model": "/m", "adapt": {"enabled": True, "collect_share": 0}},
        {"name": "c", "model": "/m", "adapt": {"collect_share": 0.5}},  # adapt off
        {"name": "d", "model": "/m", "adapt": {"enabled": True, "collect_share": 0.3}}]})
    assert config.collect_gaps() == {"a": 4, "d": 3}


def test_lookahead_defaults_to_a_whole_window_after_a_full_accept():
    assert SpeculationConfig(num_speculative_tokens=3).lookahead_tokens() == 7
    assert SpeculationConfig(num_speculative_tokens=3, lookahead=5).lookahead_tokens() == 5
    assert SpeculationConfig(num_speculative_tokens=0).lookahead_tokens() == 0


def test_branch_budget_defaults_to_f_alternatives_at_every_rejectable_position():
    assert SpeculationConfig().branch_alternatives() == 3 * (4 + 1)
    assert SpeculationConfig(num_speculative_tokens=2, branch_fan_out=2).branch_alternatives() == 6
    assert SpeculationConfig(branch_budget=7).branch_alternatives() == 7


def test_served_name_follows_the_folder():
    cfg = AppConfig.from_dict({"target": {"model": "/models/Foo-7B/"}})
    assert cfg.target.served_name() == "Foo-7B"


def test_env_numbers_become_strings():
    cfg = AppConfig.from_dict({"target": {"resources": {"env": {"OMP_NUM_THREADS": 4}}}})
    assert cfg.target.resources.env == {"OMP_NUM_THREADS": "4"}


def test_target_only_allows_k_zero():
    cfg = AppConfig.from_dict({"speculation": {"num_speculative_tokens": 0}})
    assert cfg.lookahead_tokens() == 0


# ---- validators: each error names the field ------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("target: {tensor_parallel_size: 0}", "target.tensor_parallel_size:"),
    ("target: {replicas: {min_replicas: 3, max_replicas: 2}}",
     "target.replicas: min_replicas (3) is greater than max_replicas (2)"),
    ("drafts: [{name: a, model: /m, replicas: {min_replicas: 1, max_replicas: 2, "
     "initial_replicas: 5}}]",
     "drafts[0].replicas: initial_replicas (5) must be between"),
    ("speculation: {num_speculative_tokens: 4, lookahead: 4}",
     "speculation: lookahead (4) must be greater than num_speculative_tokens (4)"),
    ("speculation: {num_speculative_tokens: 17}", "speculation.num_speculative_tokens:"),
    ("drafts: [{name: a, model: /m1}, {name: a, model: /m2}]",
     "drafts[1].name: 'a' is already the name of drafts[0]"),
    ("drafts: [{name: Bad_Name, model: /m}]", "drafts[0].name: draft name 'Bad_Name'"),
    ("drafts: [{name: a, model: /m}]\nspeculation: {num_speculative_tokens: 0}",
     "speculation.num_speculative_tokens: 0 with drafts configured"),
    ("drafts: [{model: /m}]", "drafts[0].name: Field required"),
    ("http: {port: 70000}", "http.port:"),
    ("http: {api_key: ''}", "http.api_key: api_key is empty"),
    ("target: {engine: {dtype: fp8}}", "target.engine.dtype:"),
    ("target: {resources: {gpus_per_worker: 1.5}}", "target.resources: gpus_per_worker (1.5)"),
    ("target: {resources: {accelerator_type: H100}}",
     "target.resources: accelerator_type ('H100') needs gpus_per_worker > 0"),
    ("target: {tensor_parallel_size: 2, resources: {gpus_per_worker: 0.5}}",
     "target: tensor_parallel_size 2 on GPUs needs resources.gpus_per_worker: 1"),
    ("ray: {address: auto, num_cpus: 2}", "ray: num_cpus only sizes a local cluster"),
    ("drafts: [{name: s, kind: suffix, adapt: {enabled: true}}]",
     "drafts[0]: adapt.enabled: a suffix pool has no draft model to train"),
    ("drafts: [{name: a, model: /m, adapt: {max_context_tokens: 2048}}]",
     "drafts[0].adapt: max_context_tokens (2048) must be less than per_request_tokens (2048)"),
    ("drafts: [{name: a, model: /m, adapt: {buffer_tokens: 1000}}]",
     "drafts[0].adapt: per_request_tokens (2048) is greater than buffer_tokens (1000)"),
    ("drafts: [{name: a, model: /m, adapt: {train_minutes: 40}}]",
     "drafts[0].adapt: train_minutes (40) is greater than train_every_minutes (30)"),
    ("drafts: [{name: a, model: /m, adapt: {heldout_share: 1}}]",
     "drafts[0].adapt.heldout_share:"),
    ("drafts: [{name: a, model: /m, adapt: {versions_dir: ''}}]",
     "drafts[0].adapt.versions_dir: versions_dir must not be empty"),
    ("drafts: [{name: a, model: /m, adapt: {enabld: true}}]", "drafts[0].adapt.enabld:"),
])
def test_validation_errors_name_the_field(tmp_path, text, expected):
    message = load_error(tmp_path, text)
    assert expected in message
    assert str(tmp_path / "config.yaml") in message


def test_errors_list_every_problem(tmp_path):
    with pytest.raises(ConfigError) as info:
        AppConfig.from_yaml(write(tmp_path, "target: {tensor_parallel_size: 0}\nhttp: {port: 0}"))
    assert len(info.value.errors) == 2
    assert info.value.errors[0].startswith("target.tensor_parallel_size: ")
    assert "(got 0)" in info.value.errors[0]
    assert info.value.errors[1].startswith("http.port: ")
    assert isinstance(info.value, ValueError)


def test_unknown_key_suggests_the_right_one(tmp_path):
    message = load_error(tmp_path, "target: {replicas: {max_replica: 4}}")
    assert "target.replicas.max_replica: unknown key; did you mean 'max_replicas'?" in message
    assert "valid keys: min_replicas, max_replicas" in message


def test_unknown_top_level_key(tmp_path):
    message = load_error(tmp_path, "draft: []")
    assert "draft: unknown key; did you mean 'drafts'?" in message


def test_unknown_key_inside_a_draft(tmp_path):
    message = load_error(tmp_path, "drafts: [{name: a, model: /m, engin: {}}]")
    assert "drafts[0].engin: unknown key; did you mean 'engine'?" in message


def test_bad_yaml(tmp_path):
    message = load_error(tmp_path, "target: {tensor_parallel_size: 1\nhttp: [")
    assert "is not valid YAML" in message and "line" in message


def test_duplicate_yaml_key(tmp_path):
    message = load_error(tmp_path, "http: {port: 1}\nhttp: {port: 2}")
    assert "is not valid YAML" in message and "duplicate key 'http'" in message


def test_top_level_must_be_a_mapping(tmp_path):
    assert "the top level must be a mapping" in load_error(tmp_path, "- a\n- b\n")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        AppConfig.from_yaml(tmp_path / "nope.yaml")


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        AppConfig.from_yaml(tmp_path)


# ---- overrides -----------------------------------------------------------------


def test_draft_overrides_get_unique_names():
    base = AppConfig.from_yaml(GPU_EXAMPLE)
    cfg = base.with_overrides(drafts=["/a/Llama-3.2-1B_Instruct", "/b/Llama-3.2-1B_Instruct/",
                                      "/c/llama-3-2-1b-instruct-2"])
    assert [d.name for d in cfg.drafts] == [
        "llama-3-2-1b-instruct", "llama-3-2-1b-instruct-2", "llama-3-2-1b-instruct-2-2"]
    assert [d.model for d in cfg.drafts] == [
        "/a/Llama-3.2-1B_Instruct", "/b/Llama-3.2-1B_Instruct/", "/c/llama-3-2-1b-instruct-2"]
    # Pools copy the first configured draft's settings.
    first = base.drafts[0]
    for d in cfg.drafts:
        assert (d.replicas, d.resources, d.engine) == (first.replicas, first.resources, first.engine)
    assert base.drafts[0].name == "llama-1b"  # the original is unchanged


def test_draft_overrides_without_configured_drafts_use_defaults():
    # The default's one pool is a suffix pool: its settings (0 CPUs) do not fit a model.
    cfg = AppConfig.embedded_default().with_overrides(drafts=["/m/draft", "/n/draft"])
    assert [(d.name, d.kind) for d in cfg.drafts] == [("draft", "model"), ("draft-2", "model")]
    assert cfg.drafts[0].resources.cpus_per_worker == 1
    assert cfg.drafts[0].replicas == Autoscaling()
    assert cfg.drafts[0].max_ongoing_requests == 256


def test_draft_override_names_are_valid_and_bounded():
    cfg = AppConfig().with_overrides(drafts=["/m/" + "X" * 60, "/n/" + "X" * 60, "/o/___"])
    assert [len(d.name) for d in cfg.drafts] == [40, 40, 5]
    assert cfg.drafts[1].name.endswith("-2") and cfg.drafts[2].name == "draft"


def test_empty_draft_list_means_target_only():
    assert AppConfig.from_yaml(GPU_EXAMPLE).with_overrides(drafts=[]).drafts == []


def test_draft_kinds_map_each_pool_to_its_kind():
    cfg = AppConfig.from_dict({"drafts": [{"name": "small", "model": "/m/small"},
                                          {"name": "sfx", "kind": "suffix"}]})
    assert cfg.draft_kinds() == {"small": "model", "sfx": "suffix"}
    assert AppConfig.from_dict({}).draft_kinds() == {}


def test_port_api_key_and_target_overrides():
    base = AppConfig.from_yaml(GPU_EXAMPLE)
    cfg = base.with_overrides(target="/models/Other-8B", port=9001, api_key="secret")
    assert cfg.http.port == 9001 and cfg.http.api_key == "secret"
    assert cfg.target.model == "/models/Other-8B"
    assert cfg.target.served_name() == "Other-8B"
    assert cfg.target.tensor_parallel_size == 4
    assert cfg.drafts == base.drafts
    assert base.with_overrides() == base


def test_a_model_replacing_the_default_does_not_inherit_its_context():
    base = AppConfig.embedded_default(model_draft=True)
    assert base.target.engine.max_model_len == 2048  # set for the default model
    assert base.drafts[0].engine.max_model_len == 2048
    cfg = base.with_overrides(target="/m/other", drafts=["/m/d1", "default"])
    assert cfg.target.engine.max_model_len is None  # the model's own
    assert cfg.drafts[0].engine.max_model_len is None
    assert cfg.drafts[1].engine.max_model_len == 2048  # still the default draft
    # Settings of the machine, not the model, carry over.
    assert cfg.target.engine.kv_cache_gib == base.target.engine.kv_cache_gib
    assert cfg.drafts[0].resources == base.drafts[0].resources
    # A config that names its own model keeps what it set for it.
    gpu = AppConfig.from_yaml(GPU_EXAMPLE)
    over = gpu.with_overrides(target="/m/other", drafts=["/m/d1"])
    assert over.target.engine.max_model_len == gpu.target.engine.max_model_len == 8192
    assert over.drafts[0].engine.max_model_len == 8192


def test_the_lookahead_rule_names_the_settings_as_the_caller_spells_them():
    assert lookahead_problem(4, None) is None and lookahead_problem(4, 5) is None
    assert lookahead_problem(0, 0) is None  # target-only: no W
    assert lookahead_problem(4, 4, "--num-speculative-tokens", "--lookahead") == (
        "--lookahead (4) must be greater than --num-speculative-tokens (4); raise "
        "--lookahead or remove it to use 2K + 1 (9)")


def test_overrides_are_validated():
    with pytest.raises(ConfigError, match="command line"):
        AppConfig().with_overrides(port=0)
    zero_k = AppConfig.from_dict({"speculation": {"num_speculative_tokens": 0}})
    with pytest.raises(ConfigError, match="0 with drafts configured"):
        zero_k.with_overrides(drafts=["/m/d"])


# ---- round trip ----------------------------------------------------------------


@pytest.mark.parametrize("source", [DEFAULT_CONFIG_PATH, GPU_EXAMPLE])
def test_yaml_round_trip(tmp_path, source):
    cfg = AppConfig.from_yaml(source).with_overrides(api_key="k")
    path = tmp_path / "dumped.yaml"
    path.write_text(cfg.to_yaml())
    assert AppConfig.from_yaml(path) == cfg


def test_api_key_from_an_environment_variable(monkeypatch):
    from specserve.config import ConfigError, HttpConfig

    http = HttpConfig(api_key_env="SPECSERVE_TEST_KEY")
    monkeypatch.delenv("SPECSERVE_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="SPECSERVE_TEST_KEY is not set or empty"):
        http.api_keys()
    monkeypatch.setenv("SPECSERVE_TEST_KEY", "s3cret")
    assert http.api_keys() == ("s3cret",)
    # Rotation: the old and the new key, both accepted until the old one goes.
    monkeypatch.setenv("SPECSERVE_TEST_KEY", "old-key, new-key\n")
    assert http.api_keys() == ("old-key", "new-key")
    assert HttpConfig(api_key="k").api_keys() == ("k",)
    assert HttpConfig().api_keys() == ()
    with pytest.raises(ValueError, match="set one of api_key, api_key_env, api_key_file, not "
                                         "api_key and api_key_env"):
        HttpConfig(api_key="k", api_key_env="X")
    with pytest.raises(ValueError, match="not an environment variable name"):
        HttpConfig(api_key_env="MY-KEY")
    # The CLI's --api-key replaces the variable.
    cfg = AppConfig.model_validate({"http": {"api_key_env": "X"}}).with_overrides(api_key="k")
    assert (cfg.http.api_key, cfg.http.api_key_env) == ("k", None)


def test_api_keys_from_a_file(tmp_path):
    from specserve.config import ConfigError, HttpConfig

    path = tmp_path / "keys"
    path.write_text("# rotated 2026-12\nold-key\n\n  new-key  \n")
    assert HttpConfig(api_key_file=str(path)).api_keys() == ("old-key", "new-key")
    path.write_text("# no key yet\n")
    with pytest.raises(ConfigError, match="holds no key"):
        HttpConfig(api_key_file=str(path)).api_keys()
    with pytest.raises(ConfigError, match="cannot read .*missing.*router's node"):
        HttpConfig(api_key_file=str(tmp_path / "missing")).api_keys()
    with pytest.raises(ValueError, match="not api_key_env and api_key_file"):
        HttpConfig(api_key_env="X", api_key_file=str(path))
    # The CLI's --api-key-file replaces the config's key source, as an absolute path.
    cfg = AppConfig.model_validate({"http": {"api_key": "k"}}).with_overrides(
        api_key_file="keys")
    assert cfg.http.api_key is None and cfg.http.api_key_file == str(Path("keys").resolve())
