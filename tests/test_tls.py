"""Mutual TLS on the draft sink over real gRPC on loopback (no engine): a draft
with a draft's certificate from the configured CA is served; a draft with no
certificate, a certificate from another CA, or no TLS at all is refused before
it can open a request, and a certificate from the CA for another role is
refused with PERMISSION_DENIED. Missing files fail with their path."""

import threading

import grpc
import pytest

from specserve.target.sink import DraftSink
from specserve.testing.certs import SERVER_NAME, make_pki
from specserve.tls import TlsFiles, channel_credentials, channel_options
from specserve.v1 import spec_pb2, spec_pb2_grpc


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def sink(pki):
    s = DraftSink(vocab_size=100, max_requests=8, max_pending=16)
    s.start("127.0.0.1:0", tls=TlsFiles(pki["ca"], pki["server_cert"], pki["server_key"]))
    s.register("r", [1, 2, 3], ticket="t")  # as the target's engine client does
    yield s
    s.stop()


def open_one(port, credentials, options=()):
    """Open one request over a fresh stream; the gRPC status code it ends with
    (None: still open after a second, i.e. accepted)."""
    channel = (grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=list(options))
               if credentials is not None else grpc.insecure_channel(f"127.0.0.1:{port}"))
    release = threading.Event()

    def msgs():
        yield spec_pb2.DraftMessage(open=spec_pb2.OpenRequest(request_id="r", ticket="t"))
        release.wait(5)

    call = spec_pb2_grpc.DraftSinkStub(channel).Connect(msgs())
    codes = []

    def read():
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            codes.append(e.code())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(1.5)
    return codes[0] if codes else None, call, channel, release


def close(call, channel, release):
    release.set()
    call.cancel()
    channel.close()


def test_a_draft_with_a_certificate_from_the_ca_is_served(sink, pki):
    files = TlsFiles(pki["ca"], pki["client_cert"], pki["client_key"], SERVER_NAME)
    code, *rest = open_one(sink.port, channel_credentials(files), channel_options(files))
    try:
        assert code is None
        assert sink._book.stream_of("r") is not None  # attached
    finally:
        close(*rest)


@pytest.mark.parametrize("who", ["no certificate", "another CA", "plaintext"])
def test_other_drafts_are_refused(sink, pki, who):
    if who == "no certificate":
        creds = grpc.ssl_channel_credentials(root_certificates=open(pki["ca"], "rb").read())
    elif who == "another CA":
        creds = channel_credentials(TlsFiles(pki["ca"], pki["rogue_cert"], pki["rogue_key"]))
    else:
        creds = None
    code, *rest = open_one(sink.port, creds, [("grpc.ssl_target_name_override", SERVER_NAME)])
    try:
        assert code == grpc.StatusCode.UNAVAILABLE, code
        assert sink._book.stream_of("r") is None
    finally:
        close(*rest)


def test_a_certificate_of_another_role_opens_no_draft_stream(sink, pki):
    # A certificate the same CA signed for something else (no draft name in it).
    files = TlsFiles(pki["ca"], pki["other_cert"], pki["other_key"], SERVER_NAME)
    code, *rest = open_one(sink.port, channel_credentials(files), channel_options(files))
    try:
        assert code == grpc.StatusCode.PERMISSION_DENIED, code
        assert sink._book.stream_of("r") is None
    finally:
        close(*rest)


def test_the_draft_role_is_read_from_the_certificates_names():
    from specserve.tls import DRAFT_ROLE, draft_role_problem

    draft = {"x509_common_name": [b"x"], "x509_subject_alternative_name": [DRAFT_ROLE.encode()]}
    assert draft_role_problem(draft, (DRAFT_ROLE,)) is None
    assert draft_role_problem({"x509_common_name": [DRAFT_ROLE.encode()]}, (DRAFT_ROLE,)) is None
    target = {"x509_common_name": [b"specserve-sink"],
              "x509_subject_alternative_name": [b"specserve-sink", b"127.0.0.1"]}
    assert "grpc_tls.draft_names" in draft_role_problem(target, (DRAFT_ROLE,))
    assert draft_role_problem(target, ()) is None  # no names configured: any CA certificate
    assert draft_role_problem({}, (DRAFT_ROLE,)) is not None


def test_missing_files_name_themselves(tmp_path, pki):
    files = TlsFiles(pki["ca"], str(tmp_path / "nope.crt"), pki["client_key"])
    with pytest.raises(FileNotFoundError, match=r"grpc_tls.cert_file: .*nope.crt"):
        channel_credentials(files)
    s = DraftSink(vocab_size=100)
    with pytest.raises(FileNotFoundError, match="nope.crt"):
        s.start("127.0.0.1:0", tls=files)


def test_config_section_round_trip(pki):
    from specserve.config import AppConfig, ConfigError

    cfg = AppConfig.from_dict({"grpc_tls": {"ca_file": pki["ca"], "cert_file": pki["client_cert"],
                                            "key_file": pki["client_key"],
                                            "server_name": SERVER_NAME}})
    files = TlsFiles.from_config(cfg.grpc_tls)
    from specserve.target.sink_settings import SinkSettings

    assert files.draft_names == ("specserve-draft",)  # the default role name
    settings = SinkSettings("0.0.0.0:0", max_wait_ms=5.0, tls=files)
    assert SinkSettings.from_env(settings.to_env()) == settings
    assert TlsFiles.from_config(AppConfig.from_dict({}).grpc_tls) is None
    with pytest.raises(ConfigError, match="key_file"):
        AppConfig.from_dict({"grpc_tls": {"ca_file": "a", "cert_file": "b"}})
    with pytest.raises(ConfigError, match="ca_file"):
        AppConfig.from_dict({"grpc_tls": {"ca_file": " ", "cert_file": "b", "key_file": "c"}})
