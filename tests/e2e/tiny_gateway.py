"""A gateway over a real in-process decode worker running a tiny random Llama, for tests of the
gateway's own behaviour (its front door, its schema), where the model's outputs are not the point:
the tiny model starts in about a second and makes a token in about a millisecond.

The model has SmolLM2's tokenizer and vocabulary, so prompts, the chat template and vocabulary
bounds are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx

from baton.common.engine.config import EngineConfig
from baton.services.decode.worker import DecodeWorker, DecodeWorkerConfig
from baton.services.gateway.app import GatewayConfig, make_server
from tests.e2e.fault_cluster import wait_for


def build_tiny_llama(path: Path) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer (``tests/e2e/tiny_llama.py``)."""
    from tests.e2e.tiny_llama import write_tiny_llama

    return write_tiny_llama(path, hidden=64)


@contextlib.contextmanager
def decode_worker(model: Path, redis_url: str, max_model_len: int) -> Iterator[DecodeWorker]:
    """A colocated decode worker (it prefills too: no KV transport) on its own event loop thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = EngineConfig(model=str(model), dtype="float32", kv_cache_gib=0.02, max_model_len=max_model_len)
    worker = DecodeWorker(DecodeWorkerConfig(engine=engine, redis_url=redis_url, colocated=True))
    try:
        asyncio.run_coroutine_threadsafe(worker.start(), loop).result(timeout=120)
        yield worker
    finally:
        asyncio.run_coroutine_threadsafe(worker.stop(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


@contextlib.contextmanager
def gateway(config: GatewayConfig) -> Iterator[str]:
    """The gateway under uvicorn on a thread, once ``/ready``; yields its URL."""
    server = make_server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 60, "the gateway to be ready")
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
