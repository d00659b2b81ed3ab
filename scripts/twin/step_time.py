"""The what-if twin's step-time model: how long one engine step takes, from
what the scheduler put in it.

A JSON file (``STEP_TIME_SCHEMA``), version 1, kind ``linear``::

    {"version": 1, "kind": "linear",
     "base_s": 0.025,               # every step that runs the model
     "per_decode_s": 0.0001,        # each request decoding one token
     "per_prefill_token_s": 2e-05,  # each prompt token computed
     "per_context_token_s": 1e-08,  # each token of context the step attends to
     "request_path_s": 0.003,       # a request's way from the server to the scheduler
     "request_path_quantiles_s": [0.002, ..., 0.009],  # optional: its spread
     "source": "estimate" | "measured" | "hand",
     "note": "free text (the GPU, where the figures came from)"}

step seconds = base_s + per_decode_s x decodes + per_prefill_token_s x
prefill tokens + per_context_token_s x context tokens, for a step that
schedules anything; a step that schedules nothing takes no model time.
A request reaches the scheduler ``request_path_s`` after it arrived (the
API server's HTTP handling, input processing and the hop to the engine
core); its TTFT counts from its arrival. With ``request_path_quantiles_s``
(equally spaced quantiles of the path, from its least to its largest: 11
values are p0, p10, ..., p100) each request's path is drawn from that
spread instead (a quantile drawn uniformly, linear between the given ones;
the twin's ``--seed`` fixes the draws): on a real engine a request that
reaches the scheduler a millisecond earlier or later may take its user's
next token or wait a whole period for the next one.
``DEFAULT`` (no file given) is a fixed estimate: every report marks it so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

VERSION = 1
SOURCES = ("estimate", "measured", "hand")
TERMS = ("base_s", "per_decode_s", "per_prefill_token_s", "per_context_token_s")

STEP_TIME_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "vllm-output-rate twin step-time model",
    "type": "object",
    "required": ["version", "kind", "base_s"],
    "additionalProperties": False,
    "properties": {
        "version": {"const": VERSION},
        "kind": {"const": "linear"},
        "base_s": {"type": "number", "minimum": 0,
                   "description": "seconds of every step that runs the model"},
        "per_decode_s": {"type": "number", "minimum": 0, "default": 0,
                         "description": "seconds per request decoding one token"},
        "per_prefill_token_s": {"type": "number", "minimum": 0, "default": 0,
                                "description": "seconds per prompt token computed"},
        "per_context_token_s": {"type": "number", "minimum": 0, "default": 0,
                                "description": "seconds per token of context attended "
                                               "(computed tokens of the scheduled requests)"},
        "request_path_s": {"type": "number", "minimum": 0, "default": 0,
                           "description": "seconds from a request's arrival at the server to "
                                          "the scheduler seeing it (HTTP, input processing, "
                                          "the hop to the engine core)"},
        "request_path_quantiles_s": {
            "type": "array", "minItems": 2, "items": {"type": "number", "minimum": 0},
            "description": "optional: the request path's spread, equally spaced quantiles "
                           "from the least to the largest (non-decreasing); each request's path "
                           "is drawn from it instead of request_path_s"},
        "source": {"enum": list(SOURCES), "default": "hand"},
        "note": {"type": "string"},
        "fit": {"type": "object", "description": "a measured model's fit (twin calibrate): "
                "steps, r2, median_rel_error, p90_rel_error, ..."},
        "estimate": {"type": "object", "description": "a roofline estimate's inputs (twin "
                     "calibrate --gpu): the GPU and the model's shapes"},
    },
}


class StepTimeError(ValueError):
    """A step-time file that does not follow the schema (names file and field)."""


class CalibrationError(ValueError):
    """A log or model that cannot be fitted, or estimated (``twin.calibrate``,
    ``twin.roofline``; one line for the command)."""


@dataclass(frozen=True)
class StepTimeModel:
    base_s: float
    per_decode_s: float = 0.0
    per_prefill_token_s: float = 0.0
    per_context_token_s: float = 0.0
    request_path_s: float = 0.0
    request_path_quantiles_s: tuple[float, ...] | None = None
    source: str = "hand"
    note: str = ""
    kind: str = "linear"
    version: int = VERSION
    fit: dict[str, Any] | None = None
    estimate: dict[str, Any] | None = None

    @property
    def is_estimate(self) -> bool:
        return self.source == "estimate"

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        if self.request_path_quantiles_s is not None:
            out["request_path_quantiles_s"] = list(self.request_path_quantiles_s)
        return out

    def request_path_of(self, rng: Any):
        """``() -> seconds``: each request's path, drawn with ``rng`` from
        ``request_path_quantiles_s``, or ``request_path_s`` without them."""
        qs = self.request_path_quantiles_s
        if not qs:
            fixed = self.request_path_s
            return lambda: fixed
        last = len(qs) - 1

        def draw() -> float:
            x = rng.random() * last
            i = min(int(x), last - 1)
            return qs[i] + (qs[i + 1] - qs[i]) * (x - i)

        return draw

    def seconds(self, decodes: int, prefill_tokens: int, context_tokens: int) -> float:
        if not (decodes or prefill_tokens):
            return 0.0
        return (self.base_s + self.per_decode_s * decodes
                + self.per_prefill_token_s * prefill_tokens
                + self.per_context_token_s * context_tokens)

    def step_ms_of(self, scheduler: Any):
        """``out -> milliseconds`` for the steps of ``scheduler`` (read right
        after its ``schedule()``: a request's computed tokens already count
        this step's)."""
        requests = scheduler.requests
        context = self.per_context_token_s != 0.0

        def step_ms(out: Any) -> float:
            scheduled = out.num_scheduled_tokens
            if not scheduled:
                return 0.0
            decodes = prefill = ctx = 0
            for req_id, n in scheduled.items():
                request = requests.get(req_id)
                if request is None:
                    continue
                computed = request.num_computed_tokens
                if computed - n < request.num_prompt_tokens:
                    prefill += n
                else:
                    decodes += 1
                if context:
                    ctx += computed
            return 1000.0 * self.seconds(decodes, prefill, ctx)

        return step_ms


#: The model when none is given: a fixed estimate (25 ms a step plus small
#: per-request and per-token terms), not a measurement of any engine.
DEFAULT = StepTimeModel(base_s=0.025, per_decode_s=0.0001, per_prefill_token_s=0.00002,
                        per_context_token_s=1e-8, source="estimate",
                        note="built-in default: 25 ms a step plus small per-request terms")


def parse_step_time(data: Any, where: str = "step-time") -> StepTimeModel:
    """A model from parsed JSON, checked against ``STEP_TIME_SCHEMA``."""
    if not isinstance(data, dict):
        raise StepTimeError(f"{where}: expected a JSON object, got {type(data).__name__}")
    props = STEP_TIME_SCHEMA["properties"]
    for key in STEP_TIME_SCHEMA["required"]:
        if key not in data:
            raise StepTimeError(f"{where}: {key}: missing")
    for key in data:
        if key not in props:
            raise StepTimeError(f"{where}: {key}: unknown field (known: {', '.join(props)})")
    if data["version"] != VERSION:
        raise StepTimeError(f"{where}: version: expected {VERSION}, got {data['version']!r}")
    if data["kind"] != "linear":
        raise StepTimeError(f"{where}: kind: expected \"linear\", got {data['kind']!r}")
    def number(name: str, value: Any) -> float:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < 0):
            raise StepTimeError(f"{where}: {name}: expected a number >= 0, got {value!r}")
        return float(value)

    terms: dict[str, Any] = {key: number(key, data.get(key, 0.0))
                             for key in (*TERMS, "request_path_s")}
    if "request_path_quantiles_s" in data:
        qs = data["request_path_quantiles_s"]
        key = "request_path_quantiles_s"
        if not isinstance(qs, list) or len(qs) < 2:
            raise StepTimeError(f"{where}: {key}: expected a list of at least 2 numbers, "
                                f"got {qs!r}")
        for i, value in enumerate(qs):
            number(f"{key}[{i}]", value)
            if i and value < qs[i - 1]:
                raise StepTimeError(f"{where}: {key}[{i}]: {value!r} is less than the quantile "
                                    f"before it ({qs[i - 1]!r}): the list must not decrease")
        terms["request_path_quantiles_s"] = tuple(float(v) for v in qs)
    source = data.get("source", "hand")
    if source not in SOURCES:
        raise StepTimeError(f"{where}: source: expected one of {', '.join(SOURCES)}, "
                            f"got {source!r}")
    note = data.get("note", "")
    if not isinstance(note, str):
        raise StepTimeError(f"{where}: note: expected a string, got {note!r}")
    extra = {}
    for key in ("fit", "estimate"):
        if key in data:
            if not isinstance(data[key], dict):
                raise StepTimeError(f"{where}: {key}: expected an object, got {data[key]!r}")
            extra[key] = data[key]
    return StepTimeModel(**terms, source=source, note=note, **extra)


def load_step_time(path: str | None) -> StepTimeModel:
    """The model in ``path``; ``DEFAULT`` for None."""
    if path is None:
        return DEFAULT
    from vllm_output_rate.telemetry.prompt_work import read_json

    return parse_step_time(read_json(path, StepTimeError), path)
