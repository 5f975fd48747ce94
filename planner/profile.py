"""A worker's measured costs, as the simulator and the planner read them (pure: no torch).

`baton profile` (bench/profile.py) measures the points on the machine it runs on and fits the
models below by least squares; the simulator only calls the predictors. Models, after DistServe:

- a prefill step (chunked; the step may hold pieces of several prompts) costs
  ``a + b * T + c * P`` ms, ``T`` the tokens computed in the step and ``P`` the attention pairs,
  ``sum(t_i * (prior_i + t_i))`` over its pieces (``prior_i``: the piece's tokens already cached,
  from earlier chunks or a prefix hit);
- a decode step costs ``a + b * B + c * C`` ms, ``B`` the sequences in the batch and ``C`` the
  context tokens they attend to;
- moving a prompt's KV costs ``a + b * N`` ms for ``N`` tokens, per transport;
- the gateway adds ``gateway_ms`` to a request's first token.

A served profile (``served.py``) is one of these with the served path's costs folded into the
prefill and decode models, fitted on one layout through the real gateway.

Written as versioned JSON with the machine it was taken on; ``drift`` compares two.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

VERSION = 1


@dataclass(frozen=True)
class Linear:
    """``a + b * x + c * y`` in ms; ``x`` and ``y`` as the model using it names them."""

    a: float
    b: float
    c: float = 0.0

    def __call__(self, x: float, y: float = 0.0) -> float:
        return max(0.0, self.a + self.b * x + self.c * y)


@dataclass(frozen=True)
class Machine:
    cpu: str
    """The CPU's model name, family and model (lscpu's), e.g. "AMD EPYC (family 25 model 17)"."""
    isa: str
    """The kernel level it runs (kernels/isa.py): amx, avx512-bf16, avx2."""
    cores: int
    """The cores a worker ran on while profiled."""
    gpu: str | None = None


@dataclass(frozen=True)
class EngineShape:
    model: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    tensor_parallel_size: int
    block_size: int
    max_num_batched_tokens: int
    """The chunk: most prompt tokens in one prefill step."""
    max_num_seqs: int
    kv_capacity_tokens: int
    """KV cache tokens one worker holds (its block count x block size)."""


@dataclass(frozen=True)
class Profile:
    machine: Machine
    engine: EngineShape
    prefill: Linear
    """Step ms over (tokens, attention pairs)."""
    decode: Linear
    """Step ms over (batch, context tokens)."""
    transfer: dict[str, Linear]
    """Transport name ("ucx", "gloo", ...) -> ms over tokens moved."""
    gateway_ms: float
    taken_at: str
    points: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    """The measured points each model was fitted on: {"prefill": [{"tokens", "pairs", "ms"}],
    "decode": [{"batch", "context", "ms"}], "transfer.ucx": [{"tokens", "ms"}], ...}."""
    mixed_prefill_scale: float = 1.0
    """A prefill piece in a step that also decodes costs this times its cost alone (a served
    profile's, fitted; 1 in an engine profile)."""
    host_ms: float = 0.0
    """CPU ms each streamed token costs the host outside the workers (the gateway's event, the
    client's parse), taken from every worker's cores alike (a served profile's, fitted; 0 in an
    engine profile). The simulator slows each step by the share of the cores it takes at the
    layout's current token rate."""
    served: dict = field(default_factory=dict)
    """Set in a served profile (``planner/served.py``): the layout it was calibrated on, its
    factors and the calibration's measurements; empty in an engine profile."""
    version: int = VERSION

    def prefill_ms(self, pieces: Sequence[tuple[int, int]]) -> float:
        """One prefill step over ``(new_tokens, prior_tokens)`` pieces."""
        tokens = sum(t for t, _ in pieces)
        return self.prefill(tokens, attention_pairs(pieces))

    def decode_ms(self, batch: int, context_tokens: int) -> float:
        return self.decode(batch, context_tokens) if batch else 0.0

    def transfer_ms(self, tokens: int, transport: str = "ucx") -> float:
        return self.transfer[transport](tokens)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        if d.get("version") != VERSION:
            raise ValueError(f"profile version {d.get('version')!r}; this Baton reads version {VERSION}")
        return cls(
            machine=Machine(**d["machine"]),
            engine=EngineShape(**d["engine"]),
            prefill=Linear(**d["prefill"]),
            decode=Linear(**d["decode"]),
            transfer={k: Linear(**v) for k, v in d["transfer"].items()},
            gateway_ms=float(d["gateway_ms"]),
            taken_at=d["taken_at"],
            points=d.get("points", {}),
            mixed_prefill_scale=float(d.get("mixed_prefill_scale", 1.0)),
            host_ms=float(d.get("host_ms", 0.0)),
            served=d.get("served", {}),
        )

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def attention_pairs(pieces: Sequence[tuple[int, int]]) -> int:
    """Query-key pairs a prefill step computes: each new token attends to the prior ones and the new
    ones up to itself (``t * prior + t * (t + 1) / 2``)."""
    return sum(t * p + t * (t + 1) // 2 for t, p in pieces)


def fit(
    xs: Sequence[float],
    ys: Sequence[float],
    ms: Sequence[float],
    weights: Sequence[float] | None = None,
) -> Linear:
    """Least squares of ``ms ~ a + b * x + c * y`` (normal equations; three unknowns). A ``y``
    column that is all zero fits ``a + b * x``. ``weights`` scale each point's residual (``1 / ms``
    fits relative error, for points spanning milliseconds to seconds); None weighs all alike."""
    w = [1.0] * len(ms) if weights is None else [float(v) for v in weights]
    if len(ms) < 2 or not (len(xs) == len(ys) == len(ms) == len(w)):
        raise ValueError("fit needs two or more points, as many x, y, ms and weights")
    use_y = any(y != 0 for y in ys)
    rows = [(1.0, float(x), float(y)) if use_y else (1.0, float(x)) for x, y in zip(xs, ys)]
    n = len(rows[0])
    w2 = [v * v for v in w]
    ata = [[sum(k * r[i] * r[j] for r, k in zip(rows, w2)) for j in range(n)] for i in range(n)]
    aty = [sum(k * r[i] * m for r, m, k in zip(rows, ms, w2)) for i in range(n)]
    coef = _solve(ata, aty)
    return Linear(*coef) if use_y else Linear(coef[0], coef[1], 0.0)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (an n <= 3 system)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            raise ValueError("the points do not determine the model (vary x and y)")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [v - f * w for v, w in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _paired(stored: Profile, measured: Profile) -> dict[str, list[tuple[float, float]]]:
    """Model -> (stored, measured) predictions at the stored profile's own points."""
    pts = stored.points
    out = {
        "prefill": [
            (stored.prefill(p["tokens"], p["pairs"]), measured.prefill(p["tokens"], p["pairs"]))
            for p in pts.get("prefill", [])
        ],
        "decode": [
            (stored.decode(p["batch"], p["context"]), measured.decode(p["batch"], p["context"]))
            for p in pts.get("decode", [])
        ],
    }
    for name, model in stored.transfer.items():
        if name in measured.transfer:
            out[f"transfer.{name}"] = [
                (model(p["tokens"]), measured.transfer[name](p["tokens"]))
                for p in pts.get(f"transfer.{name}", [])
            ]
    if stored.gateway_ms > 0:
        out["gateway"] = [(stored.gateway_ms, measured.gateway_ms)]
    return out


def drift(stored: Profile, measured: Profile) -> dict[str, float]:
    """Model -> the largest relative difference of its predictions at the stored profile's own
    points (``|measured - stored| / stored``); ``baton profile --check`` fails past 0.10."""
    out = {
        name: max((abs(m - s) / s for s, m in pairs if s > 0), default=0.0)
        for name, pairs in _paired(stored, measured).items()
    }
    return {k: v for k, v in out.items() if not math.isnan(v)}


def time_ratio(stored: Profile, measured: Profile) -> dict[str, float]:
    """Model -> the geometric mean of measured / stored time at the stored profile's own points:
    above 1 the machine is slower now than when the profile was taken, below 1 faster (the sign
    that ``drift`` drops; what a correction factor of the planner's would be)."""
    out = {}
    for name, pairs in _paired(stored, measured).items():
        logs = [math.log(m / s) for s, m in pairs if s > 0 and m > 0 and not math.isnan(m)]
        if logs:
            out[name] = math.exp(sum(logs) / len(logs))
    return out
