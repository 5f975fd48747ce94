"""Key layout, and the pure import: keys.py needs neither torch nor redis."""

from __future__ import annotations

import subprocess
import sys

import pytest

from baton.common.index import keys


def test_keys_live_in_one_space_per_model():
    assert keys.worker_key("m", "w1") == "baton:m:worker:w1"
    assert keys.prefix_key("m", b"\x01\xab") == "baton:m:prefix:01ab"
    assert keys.prefix_lru_key("m") == "baton:m:prefix-lru"
    assert keys.location_key("m", "req-7") == "baton:m:loc:req-7"
    assert keys.worker_key("a", "w") != keys.worker_key("b", "w")
    for key in (keys.worker_key("m", "w"), keys.prefix_key("m", b"x"), keys.location_key("m", "r")):
        assert key.startswith(keys.model_space("m"))


def test_worker_id_round_trips_through_its_key():
    key = keys.worker_key("Qwen/Qwen3-0.6B", "prefill:0")
    assert keys.worker_id_from_key("Qwen/Qwen3-0.6B", key) == "prefill:0"
    with pytest.raises(ValueError):
        keys.worker_id_from_key("other", key)


def test_worker_pattern_escapes_glob_characters_in_the_model_name():
    assert keys.worker_pattern("m*[1]") == r"baton:m\*\[1\]:worker:*"


@pytest.mark.parametrize("bad", ["", None])
def test_empty_names_are_refused(bad):
    with pytest.raises(ValueError):
        keys.worker_key("m", bad)
    with pytest.raises(ValueError):
        keys.model_space(bad)
    with pytest.raises(ValueError):
        keys.prefix_key("m", b"")


def test_keys_imports_with_torch_and_redis_blocked():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['redis'] = None\n"
        "from baton.common.index import keys\n"
        "assert keys.worker_key('m', 'w') == 'baton:m:worker:w'\n"
        "assert sys.modules['torch'] is None and sys.modules['redis'] is None\n"
        "try:\n"
        "    import redis\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('the redis block is not effective')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
