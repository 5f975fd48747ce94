"""What ``baton up`` hands its children (issue 28): credentials in the environment, never on a
command line, and a gateway that waits for the prefill pool it was started with."""

from __future__ import annotations

from baton.services.cluster_auth import ClusterAuth
from baton.services.up import UpConfig, cluster_credentials, gateway_command


def test_an_embedded_redis_gets_a_fresh_password_and_the_cluster_a_fresh_secret():
    url, auth = cluster_credentials(ClusterAuth(), None)
    _, again = cluster_credentials(ClusterAuth(), None)
    assert url is None
    assert len(auth.redis_password or "") >= 32 and len(auth.cluster_secret or "") >= 32
    assert again.redis_password != auth.redis_password and again.cluster_secret != auth.cluster_secret
    given = ClusterAuth(redis_password="given", cluster_secret="shared")
    assert cluster_credentials(given, None)[1] == given


def test_redis_url_credentials_leave_the_url_for_the_environment():
    url, auth = cluster_credentials(ClusterAuth(redis_password="flag"), "redis://baton:in%40url@redis:6379/0")
    assert url == "redis://redis:6379/0"
    assert (auth.redis_username, auth.redis_password) == ("baton", "in@url")
    url, auth = cluster_credentials(ClusterAuth(redis_password="flag"), "redis://redis:6379/0")
    assert (url, auth.redis_password) == ("redis://redis:6379/0", "flag")


def test_the_child_environment_carries_the_values_and_clears_inherited_files():
    env = ClusterAuth("user", "pw", "secret").child_env()
    assert env == {
        "BATON_REDIS_USERNAME": "user",
        "BATON_REDIS_PASSWORD": "pw",
        "BATON_REDIS_PASSWORD_FILE": "",
        "BATON_CLUSTER_SECRET": "secret",
        "BATON_CLUSTER_SECRET_FILE": "",
    }
    shown = repr(ClusterAuth("user", "pw", "secret"))
    assert "pw" not in shown and "secret" not in shown


def test_the_gateway_expects_the_prefill_pool_and_gets_no_secret_on_its_command_line():
    cfg = UpConfig(auth=ClusterAuth(redis_password="pw-123", cluster_secret="s-456"))
    cmd = gateway_command(cfg, "redis://127.0.0.1:7000/0", 2, [0])
    assert cmd[cmd.index("--expect-prefill") + 1] == "2"
    assert cmd[cmd.index("--redis-url") + 1] == "redis://127.0.0.1:7000/0"
    assert not any("pw-123" in arg or "s-456" in arg for arg in cmd)
    colocated = gateway_command(cfg, "redis://127.0.0.1:7000/0", 0, [])
    assert colocated[colocated.index("--expect-prefill") + 1] == "0"


def test_every_service_takes_the_flags_and_files_win_over_values(tmp_path):
    from baton.cli.main import build_parser
    from baton.services.cluster_auth import from_args

    (tmp_path / "pw").write_text("from-file\n")
    (tmp_path / "secret").write_text("s3cret")
    env = {"BATON_REDIS_PASSWORD": "from-env", "BATON_CLUSTER_SECRET": "env-secret"}
    files = ["--redis-password-file", str(tmp_path / "pw"), "--cluster-secret-file", str(tmp_path / "secret")]
    for command in (["gateway", "--redis-url", "redis://h:1/0"], ["decode"], ["prefill"], ["up"]):
        a = build_parser().parse_args([*command, *files, "--redis-username", "baton"])
        auth = from_args(a, env)
        assert (auth.redis_username, auth.redis_password, auth.secret) == ("baton", "from-file", b"s3cret")
        assert auth.url("redis://h:1/0") == "redis://baton:from-file@h:1/0"
        bare = from_args(build_parser().parse_args(command), env)
        assert (bare.redis_password, bare.cluster_secret) == ("from-env", "env-secret")
        assert from_args(build_parser().parse_args(command), {}) == ClusterAuth()
