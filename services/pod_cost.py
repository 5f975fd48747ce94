"""A decode worker in a Kubernetes pod keeps its pod's deletion cost at its running requests.

When a Deployment scales down, its ReplicaSet deletes the pods with the lowest
``controller.kubernetes.io/pod-deletion-cost`` first. Every running request on a decode pod that
goes must be resumed elsewhere (a re-prefill each), so the pod to remove is the one running the
fewest: each worker patches its own pod's annotation to that count. Kubernetes' docs warn against
updating it often, so it is patched only when the count has changed, at most every ``period_s``.

Outside a pod (no ``POD_NAME``/``POD_NAMESPACE``, no service account) nothing runs. The
``kubernetes`` client is imported only by ``connect_in_cluster``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"
"""Where Kubernetes mounts a pod's service account token (absent with
``automountServiceAccountToken: false``)."""
INT32_MAX = 2**31 - 1


def deletion_cost(num_running: int) -> int:
    """The annotation's value for a pod running ``num_running`` requests: the count itself (the
    fewer streams a pod would move, the sooner it goes), within the int32 the API accepts."""
    return max(0, min(int(num_running), INT32_MAX))


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str


def pod_from_env(environ: Mapping[str, str], token_file: str = TOKEN_FILE) -> PodRef | None:
    """This process's pod, when it runs in one that can call the API server: ``POD_NAMESPACE``
    and ``POD_NAME`` (the downward API) and a mounted service account token. Else None."""
    namespace, name = environ.get("POD_NAMESPACE", ""), environ.get("POD_NAME", "")
    if not (namespace and name and environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(token_file)):
        return None
    return PodRef(namespace, name)


def connect_in_cluster() -> Any:
    """A ``CoreV1Api`` with the pod's service account (the in-cluster configuration)."""
    from kubernetes import client, config

    config.load_incluster_config()
    return client.CoreV1Api()


class PodCostReporter:
    """Patches ``pod``'s deletion cost to ``deletion_cost(running())`` every ``period_s`` when it
    has changed. ``api`` is a ``kubernetes.client.CoreV1Api``. ``start()`` runs it on a daemon
    thread; ``report()`` is one round (what the thread does)."""

    def __init__(self, api: Any, pod: PodRef, running: Callable[[], int], period_s: float = 10.0):
        self.api = api
        self.pod = pod
        self.running = running
        self.period_s = period_s
        self.reported: int | None = None
        """The cost last written to the pod (None: not yet, or the last write failed)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def report(self) -> bool:
        """Patch the annotation if the cost changed; whether a patch was sent and accepted."""
        cost = deletion_cost(self.running())
        if cost == self.reported:
            return False
        body = {"metadata": {"annotations": {ANNOTATION: str(cost)}}}
        try:
            # A merge patch: it creates metadata.annotations where the pod has none.
            self.api.patch_namespaced_pod(
                self.pod.name, self.pod.namespace, body, _content_type="application/merge-patch+json"
            )
        except Exception as e:  # noqa: BLE001 - API server away or RBAC missing: say so once, go on
            if not self._failing:
                log.warning("cannot set %s on pod %s/%s: %s", ANNOTATION, *_ref(self.pod), e)
            self._failing = True
            self.reported = None
            return False
        if self._failing:
            log.info("%s on pod %s/%s set again", ANNOTATION, *_ref(self.pod))
        self._failing = False
        self.reported = cost
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pod-cost", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.report()
            if self._stop.wait(self.period_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _ref(pod: PodRef) -> tuple[str, str]:
    return pod.namespace, pod.name


def start_reporter(pod: PodRef, running: Callable[[], int], period_s: float = 10.0) -> PodCostReporter | None:
    """A started reporter for ``pod`` through the in-cluster API (the decode worker's hook); None,
    having said why, when the pod's credentials cannot be read: the worker serves without it."""
    try:
        api = connect_in_cluster()
    except Exception as e:  # noqa: BLE001 - the kubernetes client's ConfigException, or an OSError
        log.warning("no %s for pod %s/%s: %s", ANNOTATION, *_ref(pod), e)
        return None
    reporter = PodCostReporter(api, pod, running, period_s)
    reporter.start()
    return reporter
