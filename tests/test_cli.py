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
