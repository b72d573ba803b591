"""CLI input checks: a one-line error and exit code 2, before any engine starts."""


import pytest

from conftest import run_cli


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory, tiny_models):
    """Same tokenizer as the tiny target, but a model vocabulary of 384."""
    from specserve.testing.tiny import build_model

    return build_model(tmp_path_factory.mktemp("ov") / "m", seed=3, vocab_size=384)


def one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("args, needle", [
    (["--max-tokens", "0"], "max-tokens must be >= 1"),
    (["--max-tokens", "ten"], "max-tokens must be an integer"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "nan"], "temperature must be >= 0"),
    (["--num-speculative-tokens", "0"], "num-speculative-tokens must be >= 1"),
    (["--target-tp", "0"], "target-tp must be >= 1"),
    (["--seed", "-3"], "seed must be >= 0"),
])
def test_bad_numbers(tiny_models, args, needle):
    t = str(tiny_models["target"])
    one_line_error(run_cli("generate", "--target", t, "--prompt", "hi", *args), needle)


def test_missing_paths(tmp_path, tiny_models):
    one_line_error(run_cli("generate", "--target", str(tmp_path / "nope"), "--prompt", "x"),
                   "does not exist")
    (tmp_path / "empty").mkdir()
    one_line_error(run_cli("generate", "--target", str(tmp_path / "empty"), "--prompt", "x"),
                   "no config.json")
    one_line_error(run_cli("generate", "--target", str(tiny_models["target"]),
                           "--draft", str(tmp_path / "nope"), "--prompt", "x"), "draft")


def test_draft_with_another_vocabulary_is_refused(tiny_models, other_vocab):
    proc = run_cli("generate", "--target", str(tiny_models["target"]), "--draft",
                   str(other_vocab), "--prompt", "x")
    one_line_error(proc, "384", "320")
    # A hybrid draft's model too; and a hybrid spec names its model.
    proc = run_cli("generate", "--target", str(tiny_models["target"]), "--draft",
                   f"hybrid:{other_vocab}", "--prompt", "x")
    one_line_error(proc, "384", "320")
    one_line_error(run_cli("generate", "--target", str(tiny_models["target"]), "--draft",
                           "hybrid:", "--prompt", "x"), "hybrid:FOLDER")


def test_lookahead_must_exceed_k_and_prompt_must_fit(tiny_models):
    t = str(tiny_models["target"])
    one_line_error(run_cli("generate", "--target", t, "--draft", t, "--prompt", "x",
                           "--num-speculative-tokens", "4", "--lookahead", "4"), "lookahead")
    one_line_error(run_cli("generate", "--target", t, "--prompt", "x" * 1100), "context")
    one_line_error(run_cli("generate", "--target", t, "--prompt", ""), "empty")


def test_usage_errors_are_one_line_too():
    one_line_error(run_cli("generate"), "--prompt")
    one_line_error(run_cli("frobnicate"), "invalid choice")


@pytest.mark.parametrize("args, needle", [
    (["--tls-ca", "{ca}"], "TLS needs all of --tls-ca, --tls-cert and --tls-key"),
    (["--tls-ca", "{ca}", "--tls-cert", "/nope.crt", "--tls-key", "{ca}"],
     "--tls-cert /nope.crt: no such file"),
])
def test_tls_flags(tiny_models, tmp_path, args, needle):
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    t = str(tiny_models["target"])
    args = [a.format(ca=ca) for a in args]
    one_line_error(run_cli("generate", "--target", t, "--draft", t, "--prompt", "hi", *args),
                   needle)


# ---- serve: what is refused before Ray starts -----------------------------------------


def serve_args(*argv):
    from specserve.cli.parser import build_parser

    return build_parser().parse_args(["serve", *argv])


def write_config(tmp_path, config: dict) -> str:
    import yaml

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(scope="module")
def short_context(tmp_path_factory, tiny_models):
    """The tiny target's tokenizer, a context of 512 tokens."""
    from specserve.testing.tiny import build_model

    return build_model(tmp_path_factory.mktemp("short") / "m", seed=5, max_len=512)


def test_serve_refuses_a_max_model_len_the_model_cannot_take(tiny_models, tmp_path):
    t = str(tiny_models["target"])  # the tiny models take 1024 tokens
    path = write_config(tmp_path, {"target": {"model": t, "engine": {"max_model_len": 4096}},
                                   "drafts": [], "ray": {"num_cpus": 2}})
    one_line_error(run_cli("serve", path), "target.engine.max_model_len 4096", "1024 tokens")


def test_serve_refuses_a_tool_call_parser_vllm_does_not_have(tiny_models, tmp_path):
    t = str(tiny_models["target"])
    path = write_config(tmp_path, {"target": {"model": t, "tool_call_parser": "hermez"},
                                   "drafts": [], "ray": {"num_cpus": 2}})
    one_line_error(run_cli("serve", path), "target.tool_call_parser 'hermez'", "hermes")


def test_serve_refuses_pools_a_local_cluster_cannot_hold(tiny_models, tmp_path):
    t = str(tiny_models["target"])
    path = write_config(tmp_path, {
        "target": {"model": t, "resources": {"cpus_per_worker": 2}},
        "drafts": [{"name": "a", "model": t, "resources": {"cpus_per_worker": 1}}],
        "ray": {"num_cpus": 2}})
    one_line_error(run_cli("serve", path, env={"RAY_ADDRESS": ""}), "ask 3 CPUs",
                   "target 2, draft-a 1", "local Ray cluster of 2")


def test_serve_draft_takes_model_folders_only(tmp_path):
    one_line_error(run_cli("serve", "--draft", "suffix"), "--draft takes draft model folders",
                   "kind: suffix")
    one_line_error(run_cli("serve", "--draft", "hybrid:default"),
                   "--draft takes draft model folders", "kind: hybrid")
    one_line_error(run_cli("serve", "--draft", str(tmp_path / "nope")),
                   "draft model folder", "does not exist")


def test_serve_on_the_default_follows_the_named_models(short_context, monkeypatch):
    from specserve.cli.common import UsageError
    from specserve.cli.serve import check_contexts, serve_config

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    m = str(short_context)
    # Alone, the target keeps the default's suffix pool and both cores.
    cfg, _ = serve_config(serve_args("--target", m))
    assert [(d.kind, d.resources.cpus_per_worker) for d in cfg.drafts] == [("suffix", 0)]
    assert cfg.target.resources.cpus_per_worker == 2
    # A draft model starts from the default's model-draft pair: a core each.
    cfg, _ = serve_config(serve_args("--target", m, "--draft", m))
    assert [(d.kind, d.resources.cpus_per_worker) for d in cfg.drafts] == [("model", 1)]
    assert cfg.target.resources.cpus_per_worker == 1
    # The pair's max_model_len 2048 was the default model's.
    assert cfg.target.engine.max_model_len is None and cfg.drafts[0].engine.max_model_len is None
    check_contexts(cfg, m)
    forced = cfg.model_copy(update={"target": cfg.target.model_copy(update={
        "engine": cfg.target.engine.model_copy(update={"max_model_len": 2048})})})
    with pytest.raises(UsageError, match="2048 is more than the 512 tokens"):
        check_contexts(forced, m)
    # Two draft pools share the local cluster's draft core instead of asking 3 of 2.
    cfg, _ = serve_config(serve_args("--target", m, "--draft", m, "--draft", m))
    assert [d.resources.cpus_per_worker for d in cfg.drafts] == [0.5, 0.5]
    assert [d.name for d in cfg.drafts] == ["m", "m-2"]


def test_a_deployment_that_cannot_be_placed_says_what_it_asks_and_what_is_free(
        monkeypatch, capsys):
    import threading
    from types import SimpleNamespace as NS

    from specserve.cli import serve as serve_cmd
    from specserve.config import AppConfig

    cfg = AppConfig.embedded_default(model_draft=True).with_overrides(drafts=["/m/a", "/m/b"])
    unplaced = ("Deployment 'draft-b' in application 'specserve' has 1 replicas that have "
                "taken more than 30s to be scheduled. ...")
    states = iter([
        {"target": NS(status="UPDATING", message=""), "draft-a": NS(status="UPDATING", message=""),
         "draft-b": NS(status="UPDATING", message="")},
        {"target": NS(status="HEALTHY", message=""), "draft-a": NS(status="HEALTHY", message=""),
         "draft-b": NS(status="UPDATING", message=unplaced)},
    ])

    class FakeServe:
        def status(self):
            deployments = next(states, None)
            if deployments is None:
                return NS(applications={"specserve": NS(status="RUNNING", deployments={})})
            return NS(applications={"specserve": NS(status="DEPLOYING", message="",
                                                    deployments=deployments)})

    monkeypatch.setattr(serve_cmd, "_free_by_node", lambda: {"127.0.0.1": {"CPU": 0.0}})
    monkeypatch.setattr(serve_cmd.time, "sleep", lambda s: None)
    serve_cmd.wait_running(FakeServe(), threading.Event(), cfg)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "specserve: starting draft-a, draft-b, target ...",
        "specserve: starting draft-b ...",
        "specserve: draft-b waits for resources: each replica asks CPU 1, 1 replica to start; "
        "free: node 127.0.0.1: CPU 0",
    ]


def test_a_changed_config_serve_refuses_on_sighup_leaves_the_app_as_it_was(
        tiny_models, tmp_path, capsys):
    """`specserve serve`'s SIGHUP path: the file is checked before anything is
    applied (no Ray needed to refuse it)."""
    import threading

    import yaml

    from specserve.cli.serve import checked_config, reload

    path = tmp_path / "app.yaml"
    good = {"target": {"model": str(tiny_models["target"]), "name": "tiny"},
            "ray": {"num_cpus": 4}}
    path.write_text(yaml.safe_dump(good))
    args = serve_args(str(path))
    cfg = checked_config(args)
    path.write_text(yaml.safe_dump({**good, "quotas": {"max_n": 0}}))
    assert reload(args, cfg, threading.Event()) is cfg
    err = capsys.readouterr().err
    assert "the changed config is refused, the app runs on as it was" in err
    assert "quotas.max_n" in err


def test_serve_takes_api_keys_from_a_file_not_argv(tiny_models, tmp_path, monkeypatch):
    from specserve.cli.common import UsageError
    from specserve.cli.serve import serve_config

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    t = str(tiny_models["target"])
    keys = tmp_path / "keys"
    keys.write_text("old-key\nnew-key\n")
    cfg, _ = serve_config(serve_args("--target", t, "--draft", "none",
                                     "--api-key-file", str(keys)))
    assert cfg.http.api_key is None and cfg.http.api_keys() == ("old-key", "new-key")
    assert "old-key" not in cfg.to_yaml()  # the Serve config carries the path only
    with pytest.raises(UsageError, match="cannot read .*nope"):
        serve_config(serve_args("--target", t, "--draft", "none",
                                "--api-key-file", str(tmp_path / "nope")))
    with pytest.raises(SystemExit):  # one source of keys on the command line
        serve_args("--api-key", "k", "--api-key-file", str(keys))


def test_sigterm_ends_a_command_through_its_cleanup():
    """`kill` / `timeout` on a command: its `finally` and `async with` blocks
    (where engines are shut down) run and it exits 143; Python's default would
    end it at once and leave vLLM's engine processes running without it."""
    import subprocess
    import sys

    script = """
import asyncio, os, signal, sys
import specserve.cli as cli

async def body():
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(60)
    finally:
        print("cleaned up", flush=True)

def generate(args):
    asyncio.run(body())
    return 0

cli.run_generate = generate
sys.exit(cli.main(["generate", "--prompt", "x"]))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert proc.stdout == "cleaned up\n"
    assert "terminated (SIGTERM)" in proc.stderr and "Traceback" not in proc.stderr
