"""``loadtest/locustfile.py`` against a real ``baton up``: a short headless locust run of streaming
chats that must end with no failure and with TTFT and TPOT in locust's stats CSV."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.up_process import start_up, stop_up

# A load test runs alone (the suite's serial phase): beside another module's model on a 2-core
# runner, baton up's pinned workers slowed to seconds a token and 4 users finished 1 chat in 110 s.
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
LOCUST = Path(sys.executable).parent / "locust"
CHAT = ("POST", "/v1/chat/completions")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("locust-up-logs")
    port, proc = start_up(["--kv-cache-gib", "1"], logs)
    yield f"http://127.0.0.1:{port}", proc
    stop_up(proc)


def _run_locust(base: str, prefix: Path) -> subprocess.CompletedProcess:
    cmd = [str(LOCUST), "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless", "-u", "4", "-r", "2",
           "--run-time", "20s", "--stop-timeout", "90s", "--host", base, "--csv", str(prefix),
           "--exit-code-on-error", "1", "--only-summary", "--loglevel", "WARNING"]  # fmt: skip
    # No locust.conf from the working directory, no stray LOCUST_*/BATON_LOADTEST_* settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCUST_", "BATON_LOADTEST_"))}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=prefix.parent, env=env)


def _stats(prefix: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


def test_streaming_chats_under_load_report_ttft_and_tpot(cluster, tmp_path):
    base, proc = cluster
    prefix = tmp_path / "baton"
    run = _run_locust(base, prefix)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    stats = _stats(prefix)
    assert stats[("", "Aggregated")]["Failure Count"] == "0", (run.stdout + run.stderr)[-4000:]
    chat, ttft, tpot = stats[CHAT], stats[("TTFT", "chat")], stats[("TPOT", "chat")]
    chats = int(chat["Request Count"])
    assert chats >= 4  # 4 users for 20 s, each chat a few seconds at most
    assert 0 < int(tpot["Request Count"]) <= int(ttft["Request Count"]) <= chats
    assert 0 < float(ttft["Min Response Time"]) and float(ttft["Average Response Time"]) > 0
    assert float(ttft["Average Response Time"]) < float(chat["Average Response Time"])
    # Per request e2e = TTFT + TPOT * (tokens - 1), so a token takes less than the whole request.
    assert 0 < float(tpot["Average Response Time"]) < float(chat["Average Response Time"])
    assert float(tpot["Max Response Time"]) < float(chat["Max Response Time"])
    with open(f"{prefix}_failures.csv", newline="") as f:
        assert list(csv.DictReader(f)) == []
    assert proc.poll() is None, "baton up exited under load"
    with urllib.request.urlopen(f"{base}/ready", timeout=10) as r:
        assert r.status == 200
