"""Redis credentials (``common/index/auth.py``): from a file or the environment, into the URL."""

from __future__ import annotations

import pytest

from baton.common.index.auth import read_secret, split_credentials, with_credentials


def test_a_file_wins_over_the_value_and_is_stripped(tmp_path):
    path = tmp_path / "pw"
    path.write_text("  from-file\n")
    env = {"BATON_REDIS_PASSWORD": "from-env"}
    assert read_secret("BATON_REDIS_PASSWORD", str(path), env) == "from-file"
    env_file = {**env, "BATON_REDIS_PASSWORD_FILE": str(path)}
    assert read_secret("BATON_REDIS_PASSWORD", None, env_file) == "from-file"
    assert read_secret("BATON_REDIS_PASSWORD", None, env) == "from-env"
    assert read_secret("BATON_REDIS_PASSWORD", None, {"BATON_REDIS_PASSWORD_FILE": ""}) is None
    assert read_secret("BATON_REDIS_PASSWORD", None, {}) is None


def test_a_missing_or_empty_file_is_an_error(tmp_path):
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_secret("X", str(tmp_path / "empty"), {})
    with pytest.raises(ValueError, match="cannot read"):
        read_secret("X", str(tmp_path / "absent"), {})


def test_credentials_go_into_the_url_quoted_unless_it_has_a_password():
    url = "redis://redis:6379/0"
    assert with_credentials(url, None, None) == url
    assert with_credentials(url, None, "a@b:c/d") == "redis://:a%40b%3Ac%2Fd@redis:6379/0"
    assert with_credentials(url, "baton", "pw") == "redis://baton:pw@redis:6379/0"
    assert with_credentials("redis://u:own@redis:6379/0", "x", "pw") == "redis://u:own@redis:6379/0"
    assert with_credentials("rediss://redis:6380/1?ssl_cert_reqs=none", None, "pw") == (
        "rediss://:pw@redis:6380/1?ssl_cert_reqs=none"
    )


def test_split_is_the_inverse_and_leaves_a_bare_url_alone():
    url = with_credentials("redis://redis:6379/0", "baton", "a@b:c")
    assert split_credentials(url) == ("redis://redis:6379/0", "baton", "a@b:c")
    assert split_credentials("redis://:pw@h:1/0") == ("redis://h:1/0", None, "pw")
    assert split_credentials("redis://h:1/0") == ("redis://h:1/0", None, None)
