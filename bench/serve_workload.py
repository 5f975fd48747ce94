"""The requests of ``baton bench serve``'s workloads and when they arrive (pure: no client, no
torch). Prompts are random token ids (``TOKEN_RANGE``), reproducible from a seed, so that every
server sees exactly the same prompt lengths and shared prefixes."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("w2", "w3", "w4")
TOKEN_RANGE = (100, 40000)
"""Random prompt ids are drawn from this range (BENCHMARKS.md)."""

WORKLOAD_DEFAULTS = {
    # num_prompts, input_len (W3: unique suffix; W4: user tokens per turn), output_len
    "w2": (64, 256, 256),
    "w3": (64, 64, 64),
    "w4": (64, 64, 64),
}


@dataclass
class RequestSpec:
    """One request to send: its prompt as token ids and the tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int
    group: int = -1
    """W3: the prefix group; W4: the conversation."""
    turn: int = 0
    """W4: the turn (0-based); W3: the request's position in its group's send order."""
    shared_len: int = 0
    """W3: the group's prefix length (the tokens a cache could serve); W4: the history length."""
    new_len: int = 0
    """W4: the tokens this turn added (the user's)."""


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def w2_requests(num_prompts: int, input_len: int, output_len: int, seed: int) -> list[RequestSpec]:
    rng = random.Random(f"w2-{seed}")
    return [RequestSpec(random_ids(rng, input_len), output_len) for _ in range(num_prompts)]


def w3_requests(
    num_prompts: int, num_groups: int, prefix_len: int, suffix_len: int, output_len: int, seed: int
) -> list[RequestSpec]:
    """``num_prompts`` requests in ``num_groups`` groups sharing a prefix, in a shuffled order."""
    rng = random.Random(f"w3-{seed}")
    prefixes = [random_ids(rng, prefix_len) for _ in range(num_groups)]
    groups = [i % num_groups for i in range(num_prompts)]
    rng.shuffle(groups)
    seen: dict[int, int] = {}
    out = []
    for g in groups:
        turn = seen[g] = seen.get(g, -1) + 1
        ids = prefixes[g] + random_ids(rng, suffix_len)
        out.append(RequestSpec(ids, output_len, group=g, turn=turn, shared_len=prefix_len))
    return out


def arrival_delays(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each of ``n`` requests: gamma(shape=burstiness, mean=1/rate), 0 at an infinite rate."""
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    theta = 1.0 / (rate * burstiness)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=theta, size=n)]


def w4_user_turns(num_convs: int, num_turns: int, user_len: int, seed: int) -> list[list[list[int]]]:
    """The user's new tokens of every turn of every conversation (``[conversation][turn]``); each
    turn's prompt is the conversation's history so far plus these."""
    rng = random.Random(f"w4-{seed}")
    return [[random_ids(rng, user_len) for _ in range(num_turns)] for _ in range(num_convs)]


def trace_requests(rows: list[tuple[float, int, int]], seed: int) -> tuple[list[RequestSpec], list[float]]:
    """A replayed trace's requests (random prompts of each row's length, ``w2``'s kind) and the gaps
    before each: rows are ``(seconds since the first row, prompt tokens, output tokens)``, in order."""
    rng = random.Random(f"trace-{seed}")
    specs = [RequestSpec(random_ids(rng, n_in), n_out) for _, n_in, n_out in rows]
    times = [t for t, _, _ in rows]
    return specs, [b - a for a, b in zip([times[0], *times], times)]


def warm_up_request(prompt_len: int, seed: int) -> RequestSpec:
    """One request of ``prompt_len`` tokens of its own random ids (so it warms no prefix), 4 out."""
    return RequestSpec(random_ids(random.Random(f"warm-{seed}"), prompt_len), 4)
