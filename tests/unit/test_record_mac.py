"""Signing registry records (``common/index/record_mac.py``): what verifies and what does not."""

from __future__ import annotations

import json

from baton.common.index.record_mac import EXPIRES_FIELD, MAC_FIELD, RecordSigner

KEY = "baton:m:worker:d1"
RECORD = {"id": "d1", "role": "decode", "grpc_address": "10.0.0.1:5000", "load": {"free_blocks": 7.0}}
NOW = 1_800_000_000.0


def _stored(signed: dict) -> dict:
    """What a reader parses back from Redis."""
    return json.loads(json.dumps(signed, sort_keys=True))


def test_a_signed_record_verifies_after_a_json_round_trip():
    signer = RecordSigner(b"s3cret")
    signed = signer.sign(KEY, RECORD, NOW + 6)
    assert {k: v for k, v in signed.items() if k not in (MAC_FIELD, EXPIRES_FIELD)} == RECORD
    assert signed[EXPIRES_FIELD] == NOW + 6 and len(signed[MAC_FIELD]) == 64
    assert signer.verify(KEY, _stored(signed), NOW) is None


def test_unsigned_tampered_or_foreign_records_fail():
    signer = RecordSigner(b"s3cret")
    signed = _stored(signer.sign(KEY, RECORD, NOW + 6))
    assert signer.verify(KEY, dict(RECORD), NOW).startswith("unsigned")
    moved = {**signed, "grpc_address": "10.6.6.6:5000"}  # the attacker's address, the old MAC
    assert signer.verify(KEY, moved, NOW).startswith("bad MAC")
    other = _stored(RecordSigner(b"another").sign(KEY, RECORD, NOW + 6))
    assert signer.verify(KEY, other, NOW).startswith("bad MAC")
    assert signer.verify(KEY, [signed], NOW) == "not a JSON object"
    assert signer.verify(KEY, {**signed, MAC_FIELD: "é" * 64}, NOW).startswith("bad MAC")


def test_a_record_replayed_under_another_key_fails():
    signer = RecordSigner(b"s3cret")
    signed = _stored(signer.sign(KEY, RECORD, NOW + 6))
    assert signer.verify("baton:m:worker:evil", signed, NOW).startswith("bad MAC")
    assert signer.verify("baton:other-model:worker:d1", signed, NOW).startswith("bad MAC")


def test_a_signature_expires_after_its_time_and_the_clock_skew():
    signer = RecordSigner(b"s3cret", max_skew_s=30.0)
    signed = _stored(signer.sign(KEY, RECORD, NOW + 6))
    assert signer.verify(KEY, signed, NOW + 36) is None
    assert signer.verify(KEY, signed, NOW + 36.5).startswith("signature expired")
    forged_expiry = {**signed, EXPIRES_FIELD: NOW + 3600}
    assert signer.verify(KEY, forged_expiry, NOW + 60).startswith("bad MAC")


def test_the_secret_is_required_and_never_shown():
    try:
        RecordSigner(b"")
    except ValueError:
        pass
    else:
        raise AssertionError("an empty secret was accepted")
    assert "s3cret" not in repr(RecordSigner(b"s3cret"))
