"""The API-server side: who the user is, and the read-only endpoints.

vLLM decides nothing about users; by default the user is what the client
writes in ``vllm_xargs.output_rate_user``. An SRE who runs the engine behind
a gateway that authenticates callers wants the engine to believe the gateway,
not the client. Two options make the identity trusted:

* ``--output-rate-user-header NAME``: the user is that request header's
  value (the gateway sets it); the body field is ignored. Without the header
  the request is the anonymous user, or, with ``--output-rate-require-user``,
  refused with HTTP 401.
* ``--output-rate-api-keys PATH``: a file of API keys (as SHA-256 hex, never
  plain) -> user. The request's bearer token decides the user; an unknown
  token is refused with 401. With vLLM's ``--api-key`` too, its keys stay
  valid as *service keys* (a gateway's own key): such a request's user comes
  from the header option (or the body field without it). This middleware
  then checks both kinds of key itself, on the paths vLLM's own check
  guards, and vLLM's check is not installed (``settings_from_args``).

Without them the request body decides: ``vllm_xargs.output_rate_user``, and
with ``--output-rate-user-sources vllm_xargs,user`` also the OpenAI ``user``
field, read in the order given (``request_fields.user_from_sources``). A
trusted header or key always decides over every body field.

Both are done by ``OutputRateMiddleware``, an ASGI middleware that vLLM
loads through its own ``--middleware`` mechanism (the plugin adds itself to
``args.middleware`` while vLLM reads the serve arguments; ``internals``
names this). API servers spawned by ``--api-server-count N`` never parse
the options: they get them, without secrets, from the serving process
(``settings_from_args`` / ``current_options``, carried like the limits). It also serves ``GET /output-rate/...`` from handlers other
layers register (``register_route``: telemetry serves the limits and user
state from the engine's snapshot), by the read rules of ``access``: a
customer's key reads only its own user's state; listing users, other users
and the limits need an operator key (vLLM's ``--api-key`` or
``--output-rate-admin-keys``). Every 2xx completion response gets the
caller's own ``RateLimit-Policy`` / ``RateLimit`` headers (``access``; a
prompt budget is a second policy there), from
what another layer registers (``register_self_view``: telemetry reads the
engine's snapshot, so a reloaded limits file shows there as soon as the
engine has it in force) or, without it, the limits this process parsed.

Nothing here logs a key or a header value.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from vllm_output_rate.config import (
    ANONYMOUS_USER,
    DEFAULT_OPTION,
    LIMITS_FILE_OPTION,
    MAX_USER_LEN,
    ConfigFileError,
    OutputRateConfigError,
)
from vllm_output_rate import access, settings
from vllm_output_rate.access import ADMIN_KEYS_OPTION, INTROSPECTION_OPTION, OPERATOR, TENANT
from vllm_output_rate.limits_watch import POLL_S, WatchedFile
from vllm_output_rate.request_fields import DEFAULT_USER_SOURCES, USER_SOURCES_OPTION, parse_user_sources

logger = logging.getLogger("vllm_output_rate")

HEADER_OPTION = "--output-rate-user-header"
REQUIRE_OPTION = "--output-rate-require-user"
API_KEYS_OPTION = "--output-rate-api-keys"
#: What ``args.middleware`` gets (vLLM imports it by this path).
MIDDLEWARE_PATH = "vllm_output_rate.frontend.OutputRateMiddleware"
#: Paths vLLM's own key check guards (``AuthenticationMiddleware``).
GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
#: The read-only endpoints' prefix.
ROUTE_PREFIX = "/output-rate/"
#: The completion paths whose responses carry the RateLimit headers.
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")

#: The trusted user of the request being served (None: the body field rules).
IDENTITY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "output_rate_identity", default=None)
#: Where that user came from: "header" or "api_key" (None: not trusted).
IDENTITY_SOURCE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "output_rate_identity_source", default=None)

#: The user a completion request turned out to be (a one-item list the
#: middleware makes per request; the serving entry fills it in when the body
#: field decides): whose RateLimit headers the response gets.
RESPONSE_USER: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "output_rate_response_user", default=None)

#: The W3C trace context of the request being served, ``(traceparent,
#: tracestate or None)``, when the project's traces are on (None otherwise):
#: carried to the engine in the request's ``vllm_xargs``.
TRACE_CONTEXT: contextvars.ContextVar[tuple[str, str | None] | None] = contextvars.ContextVar(
    "output_rate_trace_context", default=None)

_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


# -- the API keys file ------------------------------------------------------------


def parse_api_keys(content: bytes, path: str) -> dict[str, str]:
    """``keys: {sha256 hex of a key: user}`` (YAML or JSON). Errors name the
    file, the line and the entry (by the first 8 hex digits), never a key;
    every bad entry and every digest given twice at once (``ConfigFileError``)."""
    import yaml

    from vllm_output_rate.yaml_load import load_yaml

    try:
        doc = load_yaml(content.decode("utf-8"), path)
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise OutputRateConfigError(f"{path}: not valid YAML or JSON ({type(exc).__name__})") from None
    data = doc.data
    if not isinstance(data, dict) or set(data) != {"keys"} or not isinstance(data["keys"], dict):
        raise OutputRateConfigError(
            f"{path}: expected one key 'keys', a mapping of SHA-256 (hex) of an API "
            f"key -> user (make one with: printf %s KEY | sha256sum)")
    def shown(key: Any) -> str:  # a digest by its first 8 hex digits
        return str(key) if key == "keys" else f"{str(key)[:8]}..."

    errors = [(d.again, d.message(path, shown)) for d in doc.duplicates]
    keys: dict[str, str] = {}
    for digest, user in data["keys"].items():
        line = doc.line_of(("keys", digest))
        where = f"{path}:{line}: keys.{str(digest)[:8]}..."
        if not isinstance(digest, str) or not _HEX64.match(digest.strip().lower()):
            errors.append((line, f"{where}: not a SHA-256 hex digest (64 hex digits); "
                                 f"the file holds digests of keys, never keys"))
        elif isinstance(user, bool) or not isinstance(user, (str, int)) or user == "":
            errors.append((line, f"{where}: expected a user id, got {user!r}"))
        elif len(str(user)) > MAX_USER_LEN:
            errors.append((line, f"{where}: user id longer than {MAX_USER_LEN} characters"))
        elif digest.strip().lower() in keys:
            errors.append((line, f"{where}: the digest is listed twice (in another case or spacing)"))
        else:
            keys[digest.strip().lower()] = str(user)
    if errors:
        raise ConfigFileError([m for _, m in sorted(errors, key=lambda e: e[0])])
    return keys


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ApiKeysWatcher(WatchedFile):
    """``--output-rate-api-keys``, reloaded like the limits file."""

    option = API_KEYS_OPTION
    thread_name = "output-rate-api-keys"
    what = "API keys"

    def __init__(self, path: str, poll_s: float = POLL_S, start_thread: bool = True) -> None:
        try:
            with open(path, "rb") as f:
                content = f.read()
        except OSError as exc:
            raise OutputRateConfigError(
                f"{self.option} {path}: cannot read it ({exc.strerror or exc})") from None
        try:
            keys = parse_api_keys(content, path)
        except ConfigFileError as exc:  # at start-up, name the option too
            raise ConfigFileError([f"{self.option} {e}" for e in exc.errors]) from None
        except OutputRateConfigError as exc:
            raise OutputRateConfigError(f"{self.option} {exc}") from None
        super().__init__(path, keys, hashlib.sha256(content).hexdigest(), poll_s, start_thread)

    def parse(self, content: bytes) -> dict[str, str]:
        return parse_api_keys(content, self.path)

    def accept(self, old: dict[str, str], new: dict[str, str], digest: str) -> dict[str, str]:
        logger.info("output-rate: %s reloaded from %s (sha256 %s): %d key(s), "
                    "%d added, %d removed", self.what, self.path, digest[:12], len(new),
                    len(set(new) - set(old)), len(set(old) - set(new)))
        return new


class AdminKeysWatcher(ApiKeysWatcher):
    """``--output-rate-admin-keys``: operators' keys (the API keys file's
    format; the names are only counted), reloaded the same way. They read
    ``/output-rate/``; they are no keys for ``/v1``."""

    option = ADMIN_KEYS_OPTION
    thread_name = "output-rate-admin-keys"
    what = "admin keys"


# -- the identity rules -------------------------------------------------------------


@dataclass
class Identity:
    """How this API server decides who a request's user is."""

    user_header: str | None = None
    require_user: bool = False
    api_keys: ApiKeysWatcher | None = None
    #: SHA-256 (hex) of vLLM's own ``--api-key`` values (service keys)
    service_digests: tuple[str, ...] = ()
    #: whether this middleware checks the service keys itself (vLLM's own
    #: check is off: with a keys file, listed keys must pass too)
    guards: bool = False
    #: whether the project's traces are on (``settings.traces_requested``):
    #: then each request's ``traceparent`` / ``tracestate`` go to the engine
    carry_trace: bool = False
    #: operators' keys (``--output-rate-admin-keys``)
    admin_keys: ApiKeysWatcher | None = None
    #: who reads ``/output-rate/`` (``access.introspection_mode``; None:
    #: its default for the keys this server has)
    introspection: str | None = None
    #: the request fields the user is read from when nothing trusted decides
    #: (``--output-rate-user-sources``), in order
    user_sources: tuple[str, ...] = DEFAULT_USER_SOURCES

    @property
    def trusted(self) -> bool:
        return self.user_header is not None or self.api_keys is not None

    def read_mode(self) -> str:
        return self.introspection or access.introspection_mode(None, self.has_keys())

    def has_keys(self) -> bool:
        return bool(self.api_keys is not None or self.service_digests or self.admin_keys is not None)

    def reader(self, headers: dict[str, str]) -> tuple[str | None, str | None]:
        """``(kind, own user)`` of a ``/output-rate/`` caller: OPERATOR (a
        service or admin key; its user is the header's, if any), TENANT (a
        listed key; its user), or None (no key, an unknown one, or a server
        without keys; the user header's user, if any)."""
        token = _bearer(headers.get("authorization"))
        if token is not None:
            digest = key_digest(token)
            if self._service_token(token) or (
                    self.admin_keys is not None and digest in self.admin_keys.current):
                return OPERATOR, self._header_user(headers)
            if self.api_keys is not None:
                user = self.api_keys.current.get(digest)
                if user is not None:
                    return TENANT, user
        return None, (self._header_user(headers) if not self.has_keys() else None)

    def _header_user(self, headers: dict[str, str]) -> str | None:
        if self.user_header is None:
            return None
        value = (headers.get(self.user_header.lower()) or "").strip()
        return value[:MAX_USER_LEN] or None

    def _service_token(self, token: str) -> bool:
        digest = key_digest(token).encode()
        found = False
        for known in self.service_digests:
            found |= secrets.compare_digest(digest, known.encode())
        return found

    def decide(self, headers: dict[str, str]) -> tuple[str | None, str | None, bool]:
        """``(user, refusal, listed_key)``: the trusted user (None: the body
        field decides), why the request is refused with 401 (or None), and
        whether it carried a key of the keys file."""
        if self.api_keys is not None:
            token = _bearer(headers.get("authorization"))
            if token is not None:
                user = self.api_keys.current.get(key_digest(token))
                if user is not None:
                    return user, None, True
            if token is None or not self._service_token(token):
                return None, ("Unauthorized: an API key listed for output-rate "
                              "limits is required (Authorization: Bearer KEY)"), False
        if self.user_header is None:
            return None, None, False
        value = (headers.get(self.user_header.lower()) or "").strip()
        if value:
            return value[:MAX_USER_LEN], None, False
        if self.require_user:
            return None, (f"Unauthorized: the {self.user_header} header naming the "
                          f"user is required on this server"), False
        return ANONYMOUS_USER, None, False

    def allowed(self, headers: dict[str, str]) -> bool:
        """Whether a request's key lets it read anything under
        ``/output-rate/`` (open when the server has no keys); what it may
        read is ``access.decide_read``'s."""
        return not self.has_keys() or self.reader(headers)[0] is not None


def _bearer(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, param = value.partition(" ")
    return param.strip() or None if scheme.lower() == "bearer" else None


def check_header_name(name: str) -> str:
    if not _TOKEN.match(name or ""):
        raise OutputRateConfigError(
            f"{HEADER_OPTION}: {name!r} is not an HTTP header name")
    return name


#: This process's rules (set by ``configure_frontend``; None: body field).
_identity: Identity | None = None
_options: dict[str, Any] | None = None
#: GET handlers under ``/output-rate/``: name -> handler(rest of path, query)
#: returning (status, JSON-able body).
Route = Callable[[str, dict[str, str]], Awaitable[tuple[int, Any]]]
_routes: dict[str, Route] = {}
#: user -> its own budget as the engine has it in force (``limit``, ``tier``,
#: ``listed``, ``ready_in_s``), or None when not known yet
SelfView = Callable[[str], Awaitable[dict[str, Any] | None]]
_self_view: SelfView | None = None
#: the limits this process parsed (the fallback of the RateLimit headers)
_config: Any = None


def register_route(name: str, handler: Route) -> None:
    """Serve ``GET /output-rate/<name>[/...]`` with ``handler``. Idempotent."""
    _routes[name] = handler


def register_self_view(view: SelfView) -> None:
    """Where the RateLimit headers read a caller's own budget. Idempotent."""
    global _self_view
    _self_view = view


def set_config(config: Any) -> None:
    """The limits this process parsed or inherited (``OutputRateConfig``):
    what the RateLimit headers say while no self view answers."""
    global _config
    _config = config


def note_user(user: str) -> None:
    """The serving entry says whose request this is (when the body decides)."""
    holder = RESPONSE_USER.get()
    if holder is not None and holder[0] is None:
        holder[0] = user


async def ratelimit_for(user: str) -> list[tuple[bytes, bytes]]:
    """The RateLimit headers of ``user``'s own budget (empty when unknown)."""
    view = None
    if _self_view is not None:
        view = await _self_view(user)
    if view is None and _config is not None:
        budget = _config.charged_user(user)
        view = {"limit": _config.rate_of(budget), "tier": _config.tier_of(budget),
                "listed": budget in _config.user_rates, "ready_in_s": 0.0,
                "prompt_rate": _config.prompt_rate_of(budget)}
    if view is None:
        return []
    prompt_rate = view.get("prompt_rate")  # (a number: a prompt budget, the second policy)
    return access.ratelimit_headers(
        access.limit_fraction(view["limit"]), view.get("tier"), bool(view.get("listed")),
        view.get("ready_in_s") or 0.0,
        None if prompt_rate is None or isinstance(prompt_rate, str)
        else access.limit_fraction(prompt_rate), view.get("prompt_ready_in_s") or 0.0)


def settings_from_args(args: Any) -> dict[str, Any]:
    """The identity options of vLLM's parsed serve arguments, as plain data
    without secrets (vLLM's keys as SHA-256), for this process and the API
    servers it spawns (``ACTIVE_CONFIG``). With a keys file, vLLM's own key
    check is taken over (``args.api_key`` emptied, ``VLLM_API_KEY`` unset):
    listed keys and vLLM's keys are then both checked here."""
    import os

    header = getattr(args, "output_rate_user_header", None)
    require = bool(getattr(args, "output_rate_require_user", False))
    keys_path = getattr(args, "output_rate_api_keys", None)
    admin_path = getattr(args, "output_rate_admin_keys", None)
    tokens = [t for t in (getattr(args, "api_key", None) or []) if t]
    if not tokens and os.environ.get("VLLM_API_KEY"):
        tokens = [os.environ["VLLM_API_KEY"]]
    guards = bool(keys_path)
    if guards and hasattr(args, "api_key"):
        args.api_key = None
        os.environ.pop("VLLM_API_KEY", None)
    return {"user_header": header, "require_user": require,
            "api_keys": os.path.abspath(keys_path) if keys_path else None,
            "service_sha256": [key_digest(t) for t in tokens], "guards": guards,
            "admin_keys": os.path.abspath(admin_path) if admin_path else None,
            "introspection": getattr(args, "output_rate_introspection", None),
            "user_sources": getattr(args, "output_rate_user_sources", None)}


def configure_frontend(options: dict[str, Any], feature_on: bool,
                       args: Any = None) -> Identity | None:
    """Check the identity options and load the keys file in this API-server
    process; put the middleware in ``args.middleware`` (the API servers a
    serving process spawns get that list from it). Raises
    ``OutputRateConfigError`` on bad values."""
    global _identity, _options
    header, require = options.get("user_header"), bool(options.get("require_user"))
    keys_path = options.get("api_keys")
    admin_path, wanted = options.get("admin_keys"), options.get("introspection")
    sources = parse_user_sources(options.get("user_sources"))
    if not feature_on:
        if header or require or keys_path or admin_path or wanted or options.get("user_sources"):
            raise OutputRateConfigError(
                f"{HEADER_OPTION}, {REQUIRE_OPTION}, {API_KEYS_OPTION}, {ADMIN_KEYS_OPTION}, "
                f"{INTROSPECTION_OPTION} and {USER_SOURCES_OPTION} need limits "
                f"({DEFAULT_OPTION} or {LIMITS_FILE_OPTION})")
        return None
    if require and not header:
        raise OutputRateConfigError(
            f"{REQUIRE_OPTION} needs {HEADER_OPTION}: it refuses requests without that header")
    if header is not None:
        check_header_name(header)
    mode = access.introspection_mode(
        wanted, bool(keys_path or admin_path or options.get("service_sha256")))
    identity = _identity
    if identity is None or identity.user_header != header or identity.require_user != require or (
            (identity.api_keys.path if identity.api_keys else None) != keys_path):
        if identity is not None:
            for watcher in (identity.api_keys, identity.admin_keys):
                if watcher is not None:
                    watcher.close()
        # (the keys' watcher re-reads the file on SIGHUP too)
        identity = Identity(header, require, ApiKeysWatcher(keys_path) if keys_path else None)
    if (identity.admin_keys.path if identity.admin_keys else None) != admin_path:
        if identity.admin_keys is not None:
            identity.admin_keys.close()
        identity.admin_keys = AdminKeysWatcher(admin_path) if admin_path else None
    identity.service_digests = tuple(options.get("service_sha256") or ())
    identity.introspection = mode
    identity.user_sources = sources
    identity.guards = bool(options.get("guards"))
    identity.carry_trace = settings.traces_requested()
    _identity, _options = identity, dict(options)
    middleware = getattr(args, "middleware", None)
    if isinstance(middleware, list) and MIDDLEWARE_PATH not in middleware:
        middleware.append(MIDDLEWARE_PATH)
    return identity


def current_options() -> dict[str, Any] | None:
    """What ``configure_frontend`` was given (plain data, no secrets)."""
    return _options


def current_identity() -> Identity | None:
    return _identity


def user_sources() -> tuple[str, ...]:
    """The request fields this process reads the user from (in order)."""
    return _identity.user_sources if _identity is not None else DEFAULT_USER_SOURCES


def forget_identity() -> None:
    """Drop the identity options configured in this process (its keys-file
    watcher stopped): for tools that check one option set after another in
    one process (``tools.reliability.stress``), never called while serving."""
    global _identity, _options
    if _identity is not None:
        for watcher in (_identity.api_keys, _identity.admin_keys):
            if watcher is not None:
                watcher.close()
    _identity, _options = None, None


# -- the middleware -----------------------------------------------------------------


class OutputRateMiddleware:
    """Pure ASGI: decides the trusted user of ``/v1`` requests (into
    ``IDENTITY``, read where vLLM builds the sampling parameters) and serves
    ``GET /output-rate/...``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        identity = _identity
        if scope.get("type") != "http" or identity is None:
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers") or ()}
        if path.startswith(ROUTE_PREFIX):
            await self._route(identity, path[len(ROUTE_PREFIX):], scope, headers, send)
            return
        parent = headers.get("traceparent") if identity.carry_trace else None
        if parent:
            trace = TRACE_CONTEXT.set((parent, headers.get("tracestate")))
            try:
                await self._serve(identity, scope, receive, send, path, headers)
            finally:
                TRACE_CONTEXT.reset(trace)
        else:
            await self._serve(identity, scope, receive, send, path, headers)

    async def _serve(self, identity: Identity, scope: dict, receive: Any, send: Any,
                     path: str, headers: dict[str, str]) -> None:
        if scope.get("method") == "OPTIONS" or not path.startswith(GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        user, listed = None, False
        if identity.trusted:
            user, refusal, listed = identity.decide(headers)
            if refusal is not None:
                await _send_json(send, 401, {"error": {"message": refusal,
                                                       "type": "Unauthorized", "code": 401}})
                return
        holder = None
        if scope.get("method") == "POST" and path.rstrip("/") in COMPLETION_PATHS:
            holder = [user]
            send = _with_ratelimit(send, holder)
        token = IDENTITY.set(user)
        source = IDENTITY_SOURCE.set(
            None if user is None else "api_key" if listed else "header")
        response_user = RESPONSE_USER.set(holder)
        try:
            await self.app(scope, receive, send)
        finally:
            RESPONSE_USER.reset(response_user)
            IDENTITY_SOURCE.reset(source)
            IDENTITY.reset(token)

    async def _route(self, identity: Identity, rest: str, scope: dict,
                     headers: dict[str, str], send: Any) -> None:
        if scope.get("method") not in ("GET", "HEAD"):
            await _send_json(send, 405, {"error": "only GET"})
            return
        from urllib.parse import parse_qsl, unquote

        name, _, tail = rest.partition("/")
        kind, own = identity.reader(headers)
        read = access.decide_read(identity.read_mode(), kind, own, name, unquote(tail))
        if read.status != 200:
            await _send_json(send, read.status, {"error": read.message})
            return
        handler = _routes.get(read.name)
        if handler is None:
            await _send_json(send, 404, {"error": f"no such endpoint; try "
                                                  f"{sorted([*_routes, access.ME])}"})
            return
        query = dict(parse_qsl((scope.get("query_string") or b"").decode("latin-1")))
        try:
            status, body = await handler(read.tail, query)
        except Exception:
            logger.exception("output-rate: /output-rate/%s failed", name)
            status, body = 500, {"error": "internal error (logged)"}
        await _send_json(send, status, body)


def _with_ratelimit(send: Any, holder: list) -> Any:
    """``send``, adding the caller's RateLimit headers to a 2xx response's
    start (the serving entry has named the user by then)."""

    async def send_with(message: dict) -> None:
        if (message.get("type") == "http.response.start" and holder[0] is not None
                and 200 <= message.get("status", 0) < 300):
            try:
                extra = await ratelimit_for(holder[0])
            except Exception:  # never fail a response for its headers
                logger.exception("output-rate: RateLimit headers failed")
                extra = []
            if extra:
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
        await send(message)

    return send_with


async def _send_json(send: Any, status: int, body: Any) -> None:
    data = json.dumps(body, indent=1).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
