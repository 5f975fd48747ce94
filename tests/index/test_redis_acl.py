"""Each role's Redis ACL user (``common/index/acl.py``) on a real redis-server: the role's own code
runs under it with no denial in ``ACL LOG``, and what the role must not do is refused."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
import redis

from baton.common.index import acl
from baton.common.index.client import connect
from baton.common.index.locations import BlockLocations
from baton.common.index.prefix_index import PrefixIndex
from baton.common.index.registry import WorkerInfo, WorkerRegistry

MODEL = "m"
SECRET = b"cluster-secret"
HASHES = [bytes([i]) * 8 for i in range(1, 6)]


@pytest.fixture()
def users(redis_server, client):
    """Role -> a client authenticated as that role's user; ``ACL LOG`` emptied first."""
    for role in acl.ROLES:
        client.execute_command("ACL", "SETUSER", acl.username(role), *acl.rule(role, f"pw-{role}").split())
    client.execute_command("ACL", "LOG", "RESET")
    conns = {role: connect(_url(redis_server, acl.username(role), f"pw-{role}")) for role in acl.ROLES}
    try:
        yield conns
    finally:
        for conn in conns.values():
            conn.close()
        for role in acl.ROLES:
            client.execute_command("ACL", "DELUSER", acl.username(role))


def _url(redis_server, user: str, password: str) -> str:
    parts = urlsplit(redis_server.url)
    return f"redis://{user}:{password}@{parts.hostname}:{parts.port}/0"


def _worker(worker_id: str, role: str) -> WorkerInfo:
    return WorkerInfo(worker_id, role, "127.0.0.1:1", "", "http://127.0.0.1:1/metrics")


def _denials(client) -> list:
    return client.execute_command("ACL", "LOG")


def test_each_role_runs_its_own_code_with_no_denial(users, client):
    for role in ("prefill", "decode"):
        registry = WorkerRegistry(users[role], MODEL, ttl_s=30, secret=SECRET)
        assert not registry.register(_worker(f"{role}-1", role))  # it was not there before
        assert registry.heartbeat(_worker(f"{role}-1", role).with_load(running=1))
        assert [w.id for w in registry.list(role)] == [f"{role}-1"]
        index = PrefixIndex(users[role], MODEL, max_entries=3, ttl_s=30)  # 5 blocks: the bound trims
        index.add(f"{role}-1", HASHES)
        index.ping()
        assert index.num_entries() == 3
        index.forget_worker(f"{role}-1", HASHES)
    locations = BlockLocations(users["decode"], MODEL, ttl_s=30)
    locations.put("r1", "decode-1", [1, 2], "reserved")
    assert locations.update_state("r1", "landed")
    assert locations.get("r1").state == "landed"
    assert locations.delete("r1")
    PrefixIndex(users["decode"], MODEL, max_entries=8).add("decode-1", HASHES)

    gateway = WorkerRegistry(users["gateway"], MODEL, ttl_s=30, secret=SECRET)
    assert {w.id for w in gateway.list()} == {"prefill-1", "decode-1"}
    assert gateway.get("decode-1").role == "decode"
    assert PrefixIndex(users["gateway"], MODEL, max_entries=8).longest_prefix(HASHES) == {"decode-1": 5}
    users["gateway"].ping()
    assert _denials(client) == []

    for role in ("prefill", "decode"):
        assert WorkerRegistry(users[role], MODEL, ttl_s=30, secret=SECRET).deregister(f"{role}-1")
    assert _denials(client) == []


def test_the_gateway_reads_and_writes_nothing(users, client):
    gateway = users["gateway"]
    forged = WorkerRegistry(gateway, MODEL, ttl_s=30, secret=SECRET)
    with pytest.raises(redis.exceptions.NoPermissionError):
        forged.register(_worker("mine", "decode"))  # a gateway's credentials route no prompt
    with pytest.raises(redis.exceptions.NoPermissionError):
        PrefixIndex(gateway, MODEL, max_entries=8).add("mine", HASHES)
    for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("DEL", f"baton:{MODEL}:worker:x")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            gateway.execute_command(*command)
    assert len(_denials(client)) >= 6


def test_workers_keep_to_their_commands_and_to_batons_keys(users):
    for role in ("prefill", "decode"):
        conn = users[role]
        with pytest.raises(redis.exceptions.NoPermissionError):
            conn.set("other:key", "x")  # outside baton:*
        for command in (("FLUSHALL",), ("CONFIG", "SET", "maxmemory", "1"), ("MONITOR",), ("ACL", "LIST")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                conn.execute_command(*command)
    with pytest.raises(redis.exceptions.NoPermissionError):  # the block locations are decode's
        BlockLocations(users["prefill"], MODEL, ttl_s=30).put("r1", "p", [1], "reserved")


def test_a_user_takes_only_its_own_password(redis_server, users):
    wrong = connect(_url(redis_server, acl.username("decode"), "pw-gateway"))
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            wrong.ping()
    finally:
        wrong.close()


def test_conf_lines_hold_no_password_and_name_every_role():
    text = acl.conf_lines({role: f"secret-{role}" for role in acl.ROLES})
    assert "secret-" not in text
    assert [line.split()[1] for line in text.splitlines()] == sorted(acl.username(r) for r in acl.ROLES)
    with pytest.raises(ValueError):
        acl.rule("admin", "pw")
    with pytest.raises(ValueError):
        acl.rule("gateway", "")
