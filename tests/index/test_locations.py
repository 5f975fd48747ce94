"""Block-location records against a real Redis: put, get, state updates, delete, TTL."""

from __future__ import annotations

from baton.common.index import keys
from baton.common.index.locations import BlockLocation, BlockLocations

from .helpers import wait_until

MODEL = "tiny-model"


def test_put_get_update_delete(client):
    locs = BlockLocations(client, MODEL, ttl_s=30)
    assert locs.get("r1") is None
    locs.put("r1", "d0", [7, 3, 9], "reserved")
    assert locs.get("r1") == BlockLocation("r1", "d0", (7, 3, 9), "reserved")
    assert locs.update_state("r1", "done") is True
    assert locs.get("r1") == BlockLocation("r1", "d0", (7, 3, 9), "done")
    locs.put("r1", "d1", [], "reserved")  # a put replaces the whole record
    assert locs.get("r1") == BlockLocation("r1", "d1", (), "reserved")
    assert locs.delete("r1") is True
    assert locs.delete("r1") is False
    assert locs.get("r1") is None


def test_update_of_a_missing_record_creates_nothing(client):
    locs = BlockLocations(client, MODEL, ttl_s=30)
    assert locs.update_state("ghost", "done") is False
    assert not client.exists(keys.location_key(MODEL, "ghost"))


def test_records_expire_and_updates_refresh_the_ttl(client):
    locs = BlockLocations(client, MODEL, ttl_s=0.5)
    locs.put("r1", "d0", [1], "transferring")
    key = keys.location_key(MODEL, "r1")
    assert 0 < client.pttl(key) <= 500
    client.pexpire(key, 100)
    assert locs.update_state("r1", "done") is True
    assert client.pttl(key) > 300
    assert wait_until(lambda: locs.get("r1") is None, timeout_s=5.0)
    assert locs.update_state("r1", "done") is False
