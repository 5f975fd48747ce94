"""``baton bench serve``'s client: one streamed completion sent and timed (``send_request``), and
the loops that send a workload's requests at their arrival times. The HTTP client is the caller's
(an ``httpx.AsyncClient``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from baton.bench.serve_workload import RequestSpec


@dataclass
class RequestResult:
    """What one request measured (times in seconds from its ``start``, a ``perf_counter``)."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    cached_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_bytes_per_token: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    group: int = -1
    turn: int = 0
    shared_len: int = 0
    new_len: int = 0

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


# -- one request ----------------------------------------------------------------------------------
async def _sse_data(response) -> AsyncIterator[str]:
    async for line in response.aiter_lines():
        line = line.strip()
        if line.startswith("data:"):
            yield line[5:].strip()


async def send_request(client, url: str, model: str, spec: RequestSpec, want_ids: bool) -> RequestResult:
    """Stream one completion and time it."""
    body = {
        "model": model,
        "prompt": spec.prompt_token_ids,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if want_ids:
        body["return_token_ids"] = True
    r = RequestResult(
        prompt_len=len(spec.prompt_token_ids),
        group=spec.group,
        turn=spec.turn,
        shared_len=spec.shared_len,
        new_len=spec.new_len,
    )
    st = r.start = time.perf_counter()
    last = st
    chunks_with_tokens = 0
    done = False
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {text[:300]}"
                return r
            async for data in _sse_data(resp):
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    r.error = json.dumps(msg["error"])[:300]
                    return r
                now = time.perf_counter()
                for choice in msg.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    r.output_token_ids.extend(ids)
                    if choice.get("text") or ids:
                        if chunks_with_tokens == 0:
                            r.ttft = now - st
                        else:
                            r.itl.append(now - last)
                        last = now
                        chunks_with_tokens += 1
                usage = msg.get("usage")
                if usage:
                    r.output_len = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    r.cached_tokens = int(details.get("cached_tokens") or 0)
                    r.kv_transfer_bytes = int(usage.get("kv_transfer_bytes") or 0)
                    r.kv_bytes_per_token = int(usage.get("kv_bytes_per_token") or 0)
        r.latency = time.perf_counter() - st
        if not done:
            r.error = "the stream ended without [DONE]"
        elif chunks_with_tokens == 0:
            r.error = "no tokens in the stream"
        else:
            r.output_len = r.output_len or chunks_with_tokens
            r.success = True
    except Exception as e:  # noqa: BLE001 - every failure is a failed request, counted and shown
        r.error = f"{type(e).__name__}: {e}"
    return r


async def discover_model(client, base_url: str) -> str:
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


# -- the loops ------------------------------------------------------------------------------------
async def start_at_arrivals(
    start: Callable[[int], Coroutine[Any, Any, object]], delays: Sequence[float]
) -> None:
    """``start(i)`` for every i as its own task, each after the gap ``delays[i]`` since the one
    before (an open loop: no task waits for an earlier one), then wait for them all."""
    tasks = []
    for i, delay in enumerate(delays):
        await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(start(i)))
    await asyncio.gather(*tasks)


async def run_conversations(
    one: Callable[[RequestSpec], Awaitable[RequestResult]],
    users: list[list[list[int]]],
    out_len: int,
    delays: Sequence[float],
) -> None:
    """Each conversation starts at its arrival time and sends its turns one after another; each turn's
    prompt is the history (earlier prompts and replies, as token ids) plus the user's new tokens
    (``users[conversation][turn]``). A failed turn ends its conversation."""

    async def conversation(c: int) -> None:
        history: list[int] = []
        for t, user in enumerate(users[c]):
            spec = RequestSpec(history + user, out_len, group=c, turn=t, shared_len=len(history))
            spec.new_len = len(user)
            res = await one(spec)
            if not res.success:
                return
            history = spec.prompt_token_ids + res.output_token_ids

    await start_at_arrivals(conversation, delays)
