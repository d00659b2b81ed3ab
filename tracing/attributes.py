"""Shared by the span builders: attribute names, a request's ids and
identity, spacings in whole microseconds and their quantiles.

The leaves of the tracing package: the builders (``generation``,
``throttle``, ``steps``) and the span emitter (``emit``) put these into the
attributes of the spans they make; nothing here keeps state.
"""

from __future__ import annotations

import os
import re
from typing import Any

from vllm_output_rate import user_label
from vllm_output_rate.config import ANONYMOUS_USER, UNLISTED_USER
from vllm_output_rate.observers import RequestFacts

# Attribute names of the OpenTelemetry GenAI conventions, as vLLM's own
# request span spells them (``vllm.tracing.SpanAttributes``; not imported:
# the span builder must not need vLLM's tracing module).
GEN_AI_REQUEST_ID = "gen_ai.request.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USER_ID = "user.id"
#: where the API server took a trusted user from
TRUSTED_SOURCES = ("header", "api_key")
#: users that are not a person's id (the anonymous user, the shared budget of
#: unlisted users): never a ``user.id``
_PLACEHOLDER_USERS = (ANONYMOUS_USER, UNLISTED_USER)
#: vLLM makes the engine's request id from the client's: ``f"{id}-{8 hex}"``
#: (``InputProcessor.assign_request_id``) unless this is set
_NO_RANDOM_ID_ENV = "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}\Z")


def spacing_us(ns: int) -> int:
    """A spacing in the series' unit: whole microseconds, within uint32."""
    return min(ns // 1000, 0xFFFFFFFF)


def quantile(sorted_values: list[int], q: float) -> int:
    """The sample nearest to rank q x (n - 1) of already sorted integers (0
    when empty). Not the tools' interpolating quantile
    (``vllm_output_rate.tools.common.stats.quantile``) on purpose: a span attribute
    is an integer number of microseconds and must be a spacing that occurred,
    and the engine side does not import the tools."""
    if not sorted_values:
        return 0
    index = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[index]


def _env_flag(name: str) -> bool:
    """A 0/1 variable as vLLM reads its own (anything else: off)."""
    try:
        return bool(int(os.environ.get(name, "0")))
    except ValueError:
        return False


def randomized_request_ids() -> bool:
    """Whether vLLM appends its random suffix to the client's request id
    (``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` not set)."""
    return not _env_flag(_NO_RANDOM_ID_ENV)


def external_request_id(engine_id: str, randomized: bool = True) -> str:
    """The request id vLLM's API server and its ``llm_request`` span use
    (``gen_ai.request.id``), from the engine's: vLLM appends ``-`` and 8 hex
    digits to the client's id unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``
    is set (``randomized`` False). (The children of an ``n`` > 1 request keep
    the ``{index}_`` prefix vLLM gives them.)"""
    if randomized:
        return _RANDOM_SUFFIX.sub("", engine_id)
    return engine_id


def shown_id(user: str) -> str | None:
    """A user id as spans may show it (``--output-rate-user-label``): itself,
    its salted hash, or None (``off``)."""
    return user_label.current().public_id(user)


def shown_ids(users: Any) -> list[str]:
    public = user_label.current().public_id
    return [shown for shown in map(public, users) if shown is not None]


def identity_attributes(facts: RequestFacts | None, attributes: dict[str, Any]) -> None:
    """``output_rate.user`` (whose budget the request spends), and ``user.id``
    and ``output_rate.identity_source`` only when the API server vouched for
    the user (a client's own claim in the body is no identity). Ids are
    shown as ``--output-rate-user-label`` says: raw, hashed like the
    ``user`` label, or not at all (``off``)."""
    if facts is None:
        return
    # ids as ``--output-rate-user-label`` shows them: raw, hashed or left out
    public = user_label.current().public_id
    budget = public(facts.user)
    if budget is not None:
        attributes["output_rate.user"] = budget
    source = facts.identity_source
    if source in TRUSTED_SOURCES:
        attributes["output_rate.identity_source"] = source
        who = facts.identity or facts.user  # the caller, not a shared budget
        shown = public(who) if who not in _PLACEHOLDER_USERS else None
        if shown is not None:
            attributes[USER_ID] = shown
