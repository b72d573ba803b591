"""The checked-in generated code is exactly what proto/ produces (`make proto`)."""

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_matches_the_proto(tmp_path):
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
        str(ROOT / "proto/specserve/v1/spec.proto"),
    ])
    assert rc == 0
    for name in ("spec_pb2.py", "spec_pb2.pyi", "spec_pb2_grpc.py"):
        fresh = (tmp_path / "specserve/v1" / name).read_text()
        checked_in = (ROOT / "specserve/v1" / name).read_text()
        assert fresh == checked_in, f"specserve/v1/{name} is stale: run `make proto`"


def test_every_message_names_its_request():
    from specserve.v1 import spec_pb2

    for name in ("OpenRequest", "DraftTokens", "CloseRequest", "RequestError"):
        fields = spec_pb2.DESCRIPTOR.message_types_by_name[name].fields_by_name
        assert "request_id" in fields, name
    assert "position" in spec_pb2.DESCRIPTOR.message_types_by_name["DraftTokens"].fields_by_name
    # a batch names each of its requests, and where each one's tokens start
    batch = spec_pb2.DESCRIPTOR.message_types_by_name["VerifiedBatch"].fields_by_name
    assert {"request_ids", "positions", "counts", "token_ids"} <= set(batch)
