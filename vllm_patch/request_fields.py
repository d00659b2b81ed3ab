"""What a request says about its user and its trace, read from its extra
arguments (``vllm_xargs`` in the OpenAI API): the one rule for the user
field, the request fields a server reads the user from
(``--output-rate-user-sources``: ``vllm_xargs.output_rate_user`` and, when
opted in, the OpenAI ``user`` field), the fields only the API server may set
(a trusted identity, the carried trace context), and the user whose budget a
request names.

Pure logic: used where requests are served (to refuse) and in the engine
(to resolve), by ``plugin``, ``frontend``, ``scheduler`` and ``internals``.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate.config import (
    ANONYMOUS_USER,
    MAX_USER_LEN,
    OutputRateConfigError,
    TRACEPARENT_FIELD,
    TRACESTATE_FIELD,
    TRUSTED_FIELD,
    USER_FIELD,
)


def user_of_field(value: Any) -> str:
    """The user a value of the user field names: the one rule, used where
    requests are served (to refuse) and in the engine (to resolve).

    None or empty -> the shared anonymous user; a string -> itself, cut to
    ``MAX_USER_LEN`` characters; a number -> its string form. Anything else
    (a boolean, a list, an object) is not a user: ``UserFieldError``.
    """
    if value is None or value == "":
        return ANONYMOUS_USER
    if isinstance(value, str):
        return value[:MAX_USER_LEN]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)[:MAX_USER_LEN]
    raise UserFieldError(
        f"vllm_xargs.{USER_FIELD} must be a string (the user the output-rate "
        f"limit applies to), got {type(value).__name__}"
    )


class UserFieldError(ValueError):
    """A request's user field holds something that is not a user id."""


def user_field_error(xargs: Any) -> str | None:
    """Why a request's ``vllm_xargs`` user field is unusable, or None (also
    when it is absent): what the serving entry refuses with HTTP 400."""
    if not isinstance(xargs, dict) or USER_FIELD not in xargs:
        return None
    try:
        user_of_field(xargs[USER_FIELD])
    except UserFieldError as exc:
        return str(exc)
    return None


USER_SOURCES_OPTION = "--output-rate-user-sources"
#: The request fields a user may come from: ``vllm_xargs`` is
#: ``vllm_xargs.output_rate_user``, ``user`` the OpenAI API's own ``user``
#: field (what the OpenAI SDK and LiteLLM send).
XARGS_SOURCE, OPENAI_SOURCE = "vllm_xargs", "user"
USER_SOURCES = (XARGS_SOURCE, OPENAI_SOURCE)
#: Without the option: the extra argument only (the OpenAI field ignored).
DEFAULT_USER_SOURCES = (XARGS_SOURCE,)


def parse_user_sources(value: Any) -> tuple[str, ...]:
    """``--output-rate-user-sources``: request fields, comma-separated, in
    the order they are read (the first one a request fills decides). None:
    the default. Unknown, repeated or no names are refused."""
    if value is None:
        return DEFAULT_USER_SOURCES
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else []
    expected = (f"expected request fields from {', '.join(USER_SOURCES)}, comma-separated "
                f"in the order to read them (default {XARGS_SOURCE})")
    if not names or "" in names:
        raise OutputRateConfigError(f"{USER_SOURCES_OPTION}: {expected}, got {value!r}")
    for name in names:
        if name not in USER_SOURCES:
            raise OutputRateConfigError(
                f"{USER_SOURCES_OPTION}: unknown request field {name!r} in {value!r}; {expected}")
    if len(set(names)) != len(names):
        raise OutputRateConfigError(
            f"{USER_SOURCES_OPTION}: a request field named twice in {value!r}; {expected}")
    return tuple(names)


def user_from_sources(xargs: Any, openai_user: Any,
                      sources: tuple[str, ...]) -> tuple[Any, str | None]:
    """``(the vllm_xargs the engine gets, why the request is refused or
    None)`` for a request whose user no trusted header or key decided: the
    user field set to the first of ``sources`` the request fills (absent
    when none does; an empty value fills none). A malformed
    ``vllm_xargs.output_rate_user`` is refused when that field is a source;
    a field that is not a source is ignored."""
    if sources == DEFAULT_USER_SOURCES:
        return xargs, user_field_error(xargs)
    fields = dict(xargs) if isinstance(xargs, dict) else {}
    if XARGS_SOURCE in sources:
        error = user_field_error(fields)
        if error is not None:
            return xargs, error
    given = {XARGS_SOURCE: fields.pop(USER_FIELD, None), OPENAI_SOURCE: openai_user}
    for source in sources:
        value = given[source]
        if value is not None and value != "":
            try:
                fields[USER_FIELD] = user_of_field(value)
            except UserFieldError:  # (pydantic makes ``user`` a string)
                continue
            break
    if not fields and not isinstance(xargs, dict):
        return xargs, None
    return fields, None


def trusted_source(extra_args: Any) -> str | None:
    """Where the user of a request was taken from by the API server
    ("header", "api_key"), or None (the body field: not authenticated)."""
    if not extra_args:
        return None
    try:
        value = extra_args.get(TRUSTED_FIELD)
    except AttributeError:
        return None
    return value if value in ("header", "api_key") else None


def carried_trace_headers(extra_args: Any) -> dict[str, str] | None:
    """The W3C trace headers the API server carried in a request's
    ``extra_args`` (``TRACEPARENT_FIELD``, ``TRACESTATE_FIELD``), as vLLM's
    ``trace_headers`` would hold them; None without a ``traceparent``."""
    if not extra_args:
        return None
    try:
        parent = extra_args.get(TRACEPARENT_FIELD)
        state = extra_args.get(TRACESTATE_FIELD)
    except AttributeError:
        return None
    if not isinstance(parent, str) or not parent:
        return None
    headers = {"traceparent": parent}
    if isinstance(state, str) and state:
        headers["tracestate"] = state
    return headers


def resolve_user(extra_args: Any) -> str:
    """The user of a request from ``SamplingParams.extra_args``, by
    ``user_of_field``. Never raises: a malformed field must not fail a
    request in the engine (the serving entry refused it already; other
    entries get the anonymous user)."""
    if not extra_args:
        return ANONYMOUS_USER
    try:
        return user_of_field(extra_args.get(USER_FIELD))
    except (AttributeError, UserFieldError):
        return ANONYMOUS_USER
