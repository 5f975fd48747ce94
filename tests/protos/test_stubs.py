"""The checked-in gRPC stubs are what the .proto files generate, and they describe the services."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_are_regenerated_reproducibly():
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr


def test_services_and_messages_round_trip():
    from baton.protos import baton_pb2, baton_pb2_grpc

    req = baton_pb2.PrefillRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        params=baton_pb2.SamplingParams(temperature=0.0, max_tokens=8, seed=7),
        destination=baton_pb2.TransferDescriptor(backend="ucx", host="127.0.0.1", port=5000),
        dst_block_ids=[4, 9],
    )
    back = baton_pb2.PrefillRequest.FromString(req.SerializeToString())
    assert back == req and back.params.HasField("seed") and not back.params.HasField("logprobs")
    assert hasattr(baton_pb2_grpc, "DecodeStub") and hasattr(baton_pb2_grpc, "PrefillServicer")
    methods = {m.name for m in baton_pb2.DESCRIPTOR.services_by_name["Decode"].methods}
    assert methods == {"Generate", "Abort"}
    assert baton_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name["Generate"].server_streaming
