"""``baton up``: Redis (embedded unless ``REDIS_URL``), prefill workers, decode workers and the
gateway as separate processes; waits until the gateway is ready and prints its URL. Its doors are
locked: the embedded Redis asks a fresh password, each service is its role's Redis ACL user (the
gateway only reads: ``common/index/acl.py``), the workers sign their registry records with a
fresh cluster secret, and the children get both in their environment, never on a command line
(``services/cluster_auth.py``). Then it
supervises them: a service that exits (any code, or killed) is restarted with backoff
(``procs.Backoff``) while the others keep serving, each restart logged with the exit code and
counted in ``baton:service_restarts_total{service=...}`` on its own ``/metrics`` (printed at start).
On Ctrl-C or SIGTERM it stops them all: SIGTERM to each service (workers drain, the gateway
finishes its open streams), SIGKILL for any still running after the drain timeout and a margin,
then Redis; a second Ctrl-C kills them at once."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field, replace

from baton.common.index import acl
from baton.common.launch import python_module
from baton.env import API_KEY
from baton.services.cluster_auth import ClusterAuth
from baton.services.procs import ProcessGroup, Supervisor, baton_command, wait_http_ok
from baton.services.up_autoscale import UpAutoscale, UpAutoscaler, WorkerPool

STOP_MARGIN_S = 10.0
"""Beyond the drain timeout, how long a stopping ``baton up`` waits for a service before SIGKILL."""


@dataclass(frozen=True)
class UpConfig:
    prefill: int | None = None
    """Prefill workers to start (0: decode workers prefill every prompt); None: decided from the
    machine (``services/layout.py``)."""
    decode: int = 1
    """Decode workers to start."""
    dtype: str = "auto"
    """The workers' compute dtype; ``auto``: the one this CPU multiplies natively (``gemm_probe.auto_dtypes``)."""
    kv_transport: str = "ucx"
    """How prefill workers push KV to decode workers: ``ucx`` or ``nccl``."""
    host: str = "127.0.0.1"
    port: int = 8000
    """The gateway's port."""
    engine_args: tuple[str, ...] | list[str] = ()
    """Engine flags passed to every worker."""
    gateway_args: tuple[str, ...] | list[str] = ()
    """Flags passed to the gateway."""
    tls_args: tuple[str, ...] | list[str] = ()
    """The internal gRPC's TLS flags, passed to every service (``services/grpc_tls.py``)."""
    model: str | None = None
    ready_timeout_s: float = 300.0
    block_size: int = 16
    """The workers' KV block size, told to the gateway for prefix-aware routing."""
    log_dir: str | None = None
    colocated: bool = False
    """One kind of worker that prefills and decodes (no prefill workers, no KV transfer)."""
    prefill_tp: int = 1
    """Tensor-parallel ranks of each prefill worker (``--tensor-parallel-size`` on its command)."""
    decode_tp: int = 1
    """Tensor-parallel ranks of each decode worker; the KV is re-sharded where the two differ."""
    prefill_pp: int = 1
    """Pipeline stages of each prefill worker (``--pipeline-parallel-size`` on its command)."""
    decode_pp: int = 1
    """Pipeline stages of each decode worker; the KV is re-sharded by layers where the two differ."""
    cpus: str | None = None
    """Pin workers to cores: ``auto``, ``none`` or ``|``-separated cpu lists (prefill workers
    first); None: as the layout decides."""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    """Keys the gateway asks clients for: given to it in its environment (``BATON_API_KEY``), not on
    its command line, where ``ps`` would show them."""
    max_concurrent_requests: int = 512
    """The gateway's admission limit (``--max-concurrent-requests``)."""
    max_body_bytes: int = 4 * 2**20
    """The gateway's body limit (``--max-body-bytes``)."""
    drain_timeout_s: float = 30.0
    """How long each service gets, on stop, to finish what it has in flight (``--drain-timeout``)."""
    metrics_port: int = 0
    """Port of the supervisor's own ``/metrics`` (restarts); 0 picks a free one."""
    auth: ClusterAuth = ClusterAuth()
    """Redis credentials and cluster secret given to ``baton up``; what is missing is generated
    (``cluster_credentials``)."""
    autoscale: UpAutoscale | None = None
    """Add and retire workers each interval (``services/up_autoscale.py``); None: the counts stay."""


def cluster_credentials(auth: ClusterAuth, redis_url: str | None) -> tuple[str | None, ClusterAuth]:
    """The Redis URL for the children's command lines (no credentials in it: ``ps`` shows it) and
    what they authenticate with, through their environment. An embedded Redis (``redis_url``
    None) gets a fresh password unless ``auth`` has one; ``REDIS_URL``'s own password wins over
    ``auth``'s; the cluster secret is ``auth``'s or a fresh one, so records of any other cluster
    sharing the Redis are not this cluster's workers."""
    from baton.common.index.auth import split_credentials

    if redis_url is None:
        auth = replace(auth, redis_password=auth.redis_password or secrets.token_urlsafe(32))
    else:
        redis_url, user, password = split_credentials(redis_url)
        if password is not None:
            auth = replace(auth, redis_username=user, redis_password=password)
    return redis_url, replace(auth, cluster_secret=auth.cluster_secret or secrets.token_urlsafe(32))


def _front_cpus(pins: list[list[int]] | None, num_prefill: int) -> list[int]:
    """Where ``--cpus`` puts the gateway and Redis: on the prefill workers' cores, which sit idle
    between prompts, rather than on a decode worker's, whose every step all the streams wait on.
    Colocated (no prefill workers): left to the scheduler. The cost: while a prompt prefills on
    that core, the gateway gets a share of it only, and with ~16 streams open every stream pauses
    for about the prefill (p99 ITL ~450 ms at W2 1.5 req/s). Prefill at nice 10 removed those
    pauses but lowered W2 goodput in 4 of 4 paired runs (median TPOT up 4-12 ms), so it is not done."""
    if not pins or not num_prefill:
        return []
    return sorted({c for cpus in pins[:num_prefill] for c in cpus})


def wait_connected(
    base: str,
    num_prefill: int,
    num_decode: int,
    group: ProcessGroup,
    timeout: float,
    api_key: str | None = None,
) -> None:
    """Wait until every worker is registered and every decode worker has connected to every
    prefill worker (``/workers``, which needs ``api_key`` when the gateway has keys), so that the
    first request pays no connection set-up."""
    import json
    import urllib.request

    deadline = time.monotonic() + timeout
    seen: list[dict] = []
    while time.monotonic() < deadline:
        dead = group.dead()
        if dead:
            raise RuntimeError(f"exited before the cluster was ready: {dead}")
        try:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            request = urllib.request.Request(f"{base}/workers", headers=headers)
            with urllib.request.urlopen(request, timeout=2) as r:
                seen = json.load(r)["workers"]
        except (OSError, ValueError, KeyError):
            seen = []
        decode = [w for w in seen if w["role"] == "decode"]
        prefill = [w for w in seen if w["role"] == "prefill"]
        if (
            len(decode) == num_decode
            and len(prefill) == num_prefill
            and all(w["load"].get("prefill_connected", 0) >= num_prefill for w in decode)
        ):
            return
        time.sleep(0.2)
    raise TimeoutError(
        f"workers not connected after {timeout:.0f} s: want {num_prefill} prefill and {num_decode} "
        f"decode workers, each decode worker connected to every prefill worker; saw {seen}"
    )


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop(signum)


def _kill_now(group: ProcessGroup):
    """The handler of a second Ctrl-C/SIGTERM, while stopping: every service is killed at once."""

    def kill(signum, frame) -> None:
        print("baton up: second signal: killing every service now", file=sys.stderr, flush=True)
        for _, p in group.procs:
            if p.poll() is None:
                p.kill()

    return kill


def start_redis(
    group: Supervisor,
    host: str,
    log_path: str | None,
    cpus: list[int],
    password: str,
    users: str = "",
    timeout_s: float = 10.0,
) -> tuple[str, str]:
    """The embedded ``redis-server`` as the supervised child ``redis``, asking ``password`` of its
    default user and knowing ``users`` (``acl.conf_lines``), both from a config file in its work
    folder, not its command line, so that one that dies is restarted on
    the same port (empty: workers register again at their next heartbeat). Returns its URL
    (without the password) and its work folder, which the caller removes."""
    import tempfile

    from baton.common.index.server import (
        find_redis_server,
        ping,
        server_args,
        write_password_config,
    )
    from baton.common.net import free_port

    binary = find_redis_server()
    workdir = tempfile.mkdtemp(prefix="baton-redis-")
    conf = write_password_config(workdir, password, users)
    for _ in range(3):  # another process may take the free port before Redis binds it
        port = free_port(host)
        args = server_args(binary, host, port, workdir, conf)
        group.spawn("redis", args, log_path=log_path, cpus=cpus)
        proc = dict(group.procs)["redis"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if ping(host, port):
                return f"redis://{host}:{port}/0", workdir
            time.sleep(0.02)
        group.remove("redis")
    shutil.rmtree(workdir, ignore_errors=True)
    raise RuntimeError(f"the embedded redis-server did not answer within {timeout_s:.0f} s")


def serve_restart_metrics(host: str, port: int, services: list[str]):
    """``baton:service_restarts_total{service=...}`` (a counter, 0 for each of ``services`` from the
    start) on ``http://host:port/metrics``, served by this process; ``port`` 0 picks one. Returns
    ``on_restart`` for the ``Supervisor`` and the port."""
    from prometheus_client import CollectorRegistry, Counter

    from baton.common.metrics import serve_metrics
    from baton.common.net import free_port

    registry = CollectorRegistry()
    restarts = Counter(
        "baton:service_restarts",
        "Times baton up restarted a service process after it exited.",
        ["service"],
        registry=registry,
    )
    for name in services:
        restarts.labels(service=name)
    port = port or free_port(host)
    serve_metrics(port, host, registry)
    return (lambda name, code: restarts.labels(service=name).inc()), port


def _service_names(num_prefill: int, num_decode: int, embedded_redis: bool) -> list[str]:
    names = [f"prefill-{i}" for i in range(num_prefill)] + [f"decode-{i}" for i in range(num_decode)]
    return (["redis"] if embedded_redis else []) + names + ["gateway"]


def machine_probe(model: str | None, num_cores: int) -> dict:
    """The GEMM probe that the layout needs: remembered from an earlier start, else measured in a
    child process (so that this one never loads torch) on the cores ``baton up`` may use."""
    import json
    import subprocess

    from baton.common.model import gemm_probe
    from baton.common.model.source import ModelSource
    from baton.services.layout import probe_threads

    path = ModelSource.resolve(model).path
    threads = probe_threads(num_cores)
    found = gemm_probe.cached(path, num_cores, threads)
    if found is not None:
        from dataclasses import asdict

        return asdict(found)
    print(f"Measuring this CPU's GEMMs for the layout (once per machine) on {num_cores} cores...", flush=True)
    cmd = [*python_module("baton.common.model.gemm_probe"), "--model", path, "--threads", str(num_cores)]
    cmd += ["--decode-threads", ",".join(map(str, threads)), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the GEMM probe failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def plan_cluster(cfg: UpConfig, cores: list[int]):
    """The layout for ``cfg`` on ``cores``, probing the machine only when the flags leave a choice."""
    from baton.services.layout import LayoutRequest, plan

    req = LayoutRequest(cfg.prefill, cfg.decode, cfg.colocated, cfg.cpus, cfg.dtype)
    open_choice = cfg.dtype == "auto" or (not cfg.colocated and cfg.prefill is None and len(cores) > 1)
    return plan(cores, req, machine_probe(cfg.model, len(cores)) if open_choice else None)


def run_cluster(cfg: UpConfig) -> int:
    from baton.services.procs import format_cpu_list, split_cpus

    if cfg.decode < 1 or (cfg.prefill is not None and cfg.prefill < 0):
        print("error: --decode must be at least 1 and --prefill at least 0", file=sys.stderr)
        return 2
    cores = sorted(os.sched_getaffinity(0))
    try:
        layout = plan_cluster(cfg, cores)
        num_prefill = layout.prefill
        pins = split_cpus(layout.cpus, num_prefill + cfg.decode, cores) if layout.cpus else None
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"Layout: {layout.describe()}", flush=True)
    logging.basicConfig(level=logging.INFO, format="baton up: %(message)s")
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    url, auth = cluster_credentials(cfg.auth, os.environ.get("REDIS_URL") or None)
    try:
        on_restart, metrics_port = serve_restart_metrics(
            cfg.host, cfg.metrics_port, _service_names(num_prefill, cfg.decode, not url)
        )
    except OSError as e:
        print(f"error: the supervisor's metrics on port {cfg.metrics_port}: {e}", file=sys.stderr)
        return 2
    redis_dir = None
    group = Supervisor(on_restart=on_restart)
    try:
        if cfg.log_dir:
            os.makedirs(cfg.log_dir, exist_ok=True)

        def log(name: str) -> str | None:
            return os.path.join(cfg.log_dir, f"{name}.log") if cfg.log_dir else None

        front = _front_cpus(pins, num_prefill)
        envs = {role: auth.child_env() for role in acl.ROLES}
        if not url:
            # Each service as its role's Redis user (the default user's password stays this process's).
            passwords = {role: secrets.token_urlsafe(32) for role in acl.ROLES}
            users = acl.conf_lines(passwords)
            url, redis_dir = start_redis(group, cfg.host, log("redis"), front, auth.redis_password, users)
            envs = {role: auth.as_user(acl.username(role), pw).child_env() for role, pw in passwords.items()}
        drain = ["--drain-timeout", str(cfg.drain_timeout_s)]
        n = 0
        commands: dict[str, list[str]] = {}
        for role, count in (("prefill", num_prefill), ("decode", cfg.decode)):
            for i in range(count):
                args = [*baton_command(), role, "--host", cfg.host, "--redis-url", url]
                args += ["--kv-transport", cfg.kv_transport, "--dtype", layout.dtype, *cfg.engine_args]
                args += [*drain, *cfg.tls_args]
                if layout.colocated and role == "decode":
                    args.append("--colocated")
                args += _degree_flags(cfg, role)
                commands[role] = list(args)
                if pins is not None:
                    args += ["--cpus", format_cpu_list(pins[n])]
                n += 1
                group.spawn(f"{role}-{i}", args, env=envs[role], log_path=log(f"{role}-{i}"))
        keys = {API_KEY.name: ",".join(cfg.api_keys)} if cfg.api_keys else {}
        gateway = gateway_command(cfg, url, num_prefill, front)
        group.spawn("gateway", gateway, env=envs["gateway"] | keys, log_path=log("gateway"))
        base = f"http://{cfg.host}:{cfg.port}"
        deadline = time.monotonic() + cfg.ready_timeout_s
        wait_http_ok(f"{base}/ready", group, cfg.ready_timeout_s)
        key = cfg.api_keys[0] if cfg.api_keys else None
        wait_connected(base, num_prefill, cfg.decode, group, deadline - time.monotonic(), key)
        print(f"Supervisor metrics: http://{cfg.host}:{metrics_port}/metrics (service restarts)", flush=True)
        scaler = _autoscaler(cfg, group, commands, envs, log, layout.colocated, key)
        print(f"Baton is ready: {base}/v1 (OpenAI API; Ctrl-C stops it)", flush=True)
        _supervise_forever(group, scaler)
    except _Stop:
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        _stop_cluster(group, cfg.drain_timeout_s)
        if redis_dir is not None:
            shutil.rmtree(redis_dir, ignore_errors=True)


def _supervise_forever(group: Supervisor, scaler: UpAutoscaler | None) -> None:
    """Restart what exits and, with ``--autoscale``, move the pools to their desired counts, until
    a signal ends ``baton up``."""
    while True:
        group.supervise()
        if scaler is not None:
            scaler.tick()
        time.sleep(0.2)


def _autoscaler(
    cfg: UpConfig, group: Supervisor, commands, envs, log, colocated: bool, key
) -> UpAutoscaler | None:
    """``--autoscale``'s loop over the pools as they started (a pool is grown from its command)."""
    if cfg.autoscale is None:
        return None
    roles = {"colocated": "decode"} if colocated else {"prefill": "prefill", "decode": "decode"}
    pools = {p: WorkerPool(group, r, commands[r], envs[r], log) for p, r in roles.items() if r in commands}
    base = f"http://{cfg.host}:{cfg.port}"
    try:
        return UpAutoscaler(cfg.autoscale, base, key, pools, colocated, cfg.drain_timeout_s + STOP_MARGIN_S)
    except ValueError as e:
        raise RuntimeError(str(e)) from None


def gateway_command(cfg: UpConfig, redis_url: str, num_prefill: int, cpus: list[int]) -> list[str]:
    """The gateway's command line: its ``/ready`` waits for the ``num_prefill`` prefill workers
    (``--expect-prefill``), so that ``baton up``, which waits on ``/ready``, is ready only once the
    gateway routes to them. No secret is on it (``ps`` shows it): those go in its environment."""
    from baton.services.procs import format_cpu_list

    gateway = [*baton_command(), "gateway", "--host", cfg.host, "--port", str(cfg.port)]
    gateway += ["--redis-url", redis_url, "--expect-prefill", str(num_prefill)]
    gateway += [*cfg.gateway_args, "--drain-timeout", str(cfg.drain_timeout_s), *cfg.tls_args]
    if cfg.model:
        gateway += ["--model", cfg.model]
    if cpus:
        gateway += ["--cpus", format_cpu_list(cpus)]
    gateway += ["--max-concurrent-requests", str(cfg.max_concurrent_requests)]
    gateway += ["--max-body-bytes", str(cfg.max_body_bytes)]
    return gateway


def _degree_flags(cfg: UpConfig, role: str) -> list[str]:
    """A worker's own tensor- and pipeline-parallel degrees, as flags that come after
    ``engine_args`` (whose ``--tensor-parallel-size`` and ``--pipeline-parallel-size`` they win over)."""
    prefill = role == "prefill"
    flags = []
    for flag, n in (
        ("--tensor-parallel-size", cfg.prefill_tp if prefill else cfg.decode_tp),
        ("--pipeline-parallel-size", cfg.prefill_pp if prefill else cfg.decode_pp),
    ):
        if n > 1 or flag in cfg.engine_args:
            flags += [flag, str(n)]
    return flags


def _stop_cluster(group: ProcessGroup, drain_timeout_s: float) -> None:
    """SIGTERM every service at once and wait for their drains (SIGKILL past the drain timeout and
    ``STOP_MARGIN_S``); Redis last, once no worker needs it to leave the registry."""
    signal.signal(signal.SIGINT, _kill_now(group))
    signal.signal(signal.SIGTERM, _kill_now(group))
    services = [name for name, _ in group.procs if name != "redis"]
    group.stop(drain_timeout_s + STOP_MARGIN_S, names=services)
    group.stop(5.0, names=["redis"])
