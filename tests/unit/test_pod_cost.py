"""The decode pod's deletion cost: the pure cost, when a pod can report it, and the reporter
against a tiny local HTTP server that answers the API server's PATCH, reached through the real
``kubernetes`` client from a kubeconfig (the API server is the fault-free thing here, not the
thing under test)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from baton.services.pod_cost import (
    ANNOTATION,
    INT32_MAX,
    PodCostReporter,
    PodRef,
    deletion_cost,
    pod_from_env,
)

POD = PodRef("baton", "baton-decode-7d9f8-x2x4z")
TOKEN = "test-token"


@pytest.mark.parametrize("running, cost", [(0, 0), (3, 3), (-1, 0), (2**40, INT32_MAX)])
def test_the_cost_is_the_running_requests_within_int32(running, cost):
    assert deletion_cost(running) == cost


def test_only_a_pod_with_a_service_account_reports(tmp_path):
    token = tmp_path / "token"
    env = {"POD_NAMESPACE": "baton", "POD_NAME": POD.name, "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert pod_from_env(env, str(token)) is None  # automountServiceAccountToken: false
    token.write_text(TOKEN)
    assert pod_from_env(env, str(token)) == POD
    for missing in env:
        assert pod_from_env({k: v for k, v in env.items() if k != missing}, str(token)) is None


class FakeApiServer:
    """Answers PATCH /api/v1/namespaces/<ns>/pods/<name> as the API server does (the patched pod),
    or with ``status`` when set; records what it got."""

    def __init__(self):
        self.patches: list[dict] = []
        self.status = 200
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_PATCH(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.patches.append(
                    {
                        "path": self.path,
                        "content_type": self.headers["Content-Type"],
                        "auth": self.headers.get("Authorization"),
                        "body": body,
                    }
                )
                if outer.status != 200:
                    reply = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": outer.status}
                else:
                    _, _, _, ns, _, name = self.path.strip("/").split("/")[:6]
                    meta = {"name": name, "namespace": ns, **body["metadata"]}
                    reply = {"kind": "Pod", "apiVersion": "v1", "metadata": meta}
                data = json.dumps(reply).encode()
                self.send_response(outer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def costs(self) -> list[str]:
        return [p["body"]["metadata"]["annotations"][ANNOTATION] for p in self.patches]


@pytest.fixture
def api_server():
    server = FakeApiServer()
    server.thread.start()
    yield server
    server.server.shutdown()


@pytest.fixture
def api(api_server, tmp_path):
    """A real ``CoreV1Api``, configured from a kubeconfig that points at the fake server."""
    from kubernetes import client, config

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": api_server.url}}],
                "users": [{"name": "u", "user": {"token": TOKEN}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "baton"}}],
                "current-context": "x",
            }
        )
    )
    return client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))


def test_the_reporter_patches_its_own_pod_when_the_count_changes(api_server, api):
    running = iter([0, 0, 2, 2, 5, 1])
    reporter = PodCostReporter(api, POD, lambda: next(running))
    sent = [reporter.report() for _ in range(6)]
    assert sent == [True, False, True, False, True, True]
    assert api_server.costs() == ["0", "2", "5", "1"]
    first = api_server.patches[0]
    assert first["path"] == f"/api/v1/namespaces/baton/pods/{POD.name}"
    # A merge patch creates metadata.annotations on a pod that has none (a JSON patch would fail).
    assert first["content_type"] == "application/merge-patch+json"
    assert first["auth"] == f"Bearer {TOKEN}"
    assert reporter.reported == 1


def test_a_refused_patch_is_sent_again_once_the_api_server_answers(api_server, api):
    reporter = PodCostReporter(api, POD, lambda: 3)
    api_server.status = 403  # RBAC missing, or the API server away
    assert not reporter.report() and reporter.reported is None
    assert not reporter.report()
    api_server.status = 200
    assert reporter.report() and reporter.reported == 3
    assert api_server.costs() == ["3", "3", "3"]
    assert not reporter.report()  # and then quiet again


def test_the_reporter_thread_follows_the_load_and_stops(api_server, api):
    load = {"running": 4}
    reporter = PodCostReporter(api, POD, lambda: load["running"], period_s=0.05)
    reporter.start()
    try:
        deadline = time.monotonic() + 10
        while api_server.costs() != ["4"] and time.monotonic() < deadline:
            time.sleep(0.02)
        load["running"] = 0
        while api_server.costs() != ["4", "0"] and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        reporter.stop()
    assert api_server.costs() == ["4", "0"]
    assert not reporter._thread.is_alive()
