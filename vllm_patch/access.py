"""Tenant isolation on the API server: who may read what under
``/output-rate/``, and what a caller learns about itself on every
completion response.

Pure rules (no I/O, no vLLM); ``frontend``'s middleware applies them.

Callers of ``/output-rate/`` are of three kinds, by their bearer key:

* an *operator*: a key of vLLM's ``--api-key`` (a service key) or of
  ``--output-rate-admin-keys`` (a file in the API keys file's format);
* a *tenant*: a key of ``--output-rate-api-keys`` (a customer's own key,
  which decides its user);
* nobody: no key, or a key the server does not know (HTTP 401).

``--output-rate-introspection`` says what each may read:

``own`` (the default when the server has keys)
    An operator reads everything; a tenant reads only its own user's state
    (``/output-rate/me`` or ``/output-rate/users/<its own user>``); listing
    users, reading another user and reading the limits document are
    refused with 403, in a message that names no user.
``operators``
    Only operator keys read; a tenant's key gets 403.
``off``
    Every ``/output-rate/`` path answers 404.

A server without any key (as plain vLLM is) has nothing to tell callers
apart: the endpoints stay open to whoever reaches the port (``open``), or
closed with ``off``; asking for ``own`` or ``operators`` there is refused at
start-up. Such a port must not face tenants.

What a caller learns about itself: every completion response carries the
caller's own limit in the shape of the IETF RateLimit header fields draft
(``RateLimit-Policy`` / ``RateLimit``), adapted to tokens per second
(``ratelimit_headers``): nothing there names or measures another user.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from vllm_output_rate.config import OutputRateConfigError

ADMIN_KEYS_OPTION = "--output-rate-admin-keys"
INTROSPECTION_OPTION = "--output-rate-introspection"
#: What ``--output-rate-introspection`` takes.
INTROSPECTION_MODES = ("off", "operators", "own")
#: The mode of a server without any key (not a value of the option).
OPEN = "open"

OPERATOR, TENANT = "operator", "tenant"

#: The one refusal a tenant gets for anything but its own state.
OWN_ONLY = ("Forbidden: this key reads only its own user's state "
            "(GET /output-rate/me); listing users, other users and the limits "
            "document need an operator key")
OPERATORS_ONLY = ("Forbidden: on this server only operator keys (--api-key, "
                  "--output-rate-admin-keys) read /output-rate/")
CLOSED = f"introspection is off on this server ({INTROSPECTION_OPTION} off)"
#: The self-service endpoint: the caller's own user's state.
ME = "me"


def introspection_mode(requested: str | None, has_keys: bool) -> str:
    """The mode in force: ``requested`` checked against the server's keys.
    Raises ``OutputRateConfigError`` naming the option and the value."""
    if requested is not None and requested not in INTROSPECTION_MODES:
        raise OutputRateConfigError(
            f"{INTROSPECTION_OPTION}: expected one of {', '.join(INTROSPECTION_MODES)}, "
            f"got {requested!r}")
    if requested == "off":
        return "off"
    if not has_keys:
        if requested is not None:
            raise OutputRateConfigError(
                f"{INTROSPECTION_OPTION} {requested} needs keys to tell callers apart "
                f"(--api-key, {ADMIN_KEYS_OPTION} or --output-rate-api-keys); without "
                f"any the endpoints are open to whoever reaches the port: give "
                f"{INTROSPECTION_OPTION} off to close them")
        return OPEN
    return requested or "own"


@dataclass(frozen=True)
class Read:
    """What the middleware does with one ``GET /output-rate/...``: serve
    ``name``/``tail`` (``status`` 200) or refuse with ``status`` and
    ``message``."""

    status: int
    name: str = ""
    tail: str = ""
    message: str = ""


def decide_read(mode: str, kind: str | None, own_user: str | None,
                name: str, tail: str) -> Read:
    """The read rule. ``kind``: OPERATOR, TENANT or None (no key or an
    unknown one); ``own_user``: the user the caller's request names (its
    key's user for a tenant; the user header's for an operator, if any);
    ``name``/``tail``: the path after ``/output-rate/`` (``tail`` already
    unquoted)."""
    if mode == "off":
        return Read(404, message=CLOSED)
    if mode != OPEN and kind is None:
        return Read(401, message="Unauthorized")
    if mode == "operators" and kind != OPERATOR:
        return Read(403, message=OPERATORS_ONLY)
    if name == ME:
        if own_user is None:
            return Read(400, message="this request names no user (for an operator key: "
                                     "the user header, if the server takes one)")
        return Read(200, "users", own_user)
    if kind == TENANT and not (name == "users" and tail == own_user):
        return Read(403, message=OWN_ONLY)
    return Read(200, name, tail)


# -- the RateLimit header fields ----------------------------------------------------

#: The quota unit of the policies (the draft's ``qu``, an extension value):
#: the output limit's, and the prompt budget's (a second policy).
QUOTA_UNIT = "output-tokens"
PROMPT_QUOTA_UNIT = "prompt-tokens"
#: The prompt budget's policy is the output policy's name and this suffix.
PROMPT_POLICY_SUFFIX = "-prompt"


def policy_name(tier: str | None, listed: bool) -> str:
    """The policy's name: the tier, else ``user`` (a listed user's own limit)
    or ``default`` (the default limit, also the shared unlisted budget)."""
    if tier:
        return tier
    return "user" if listed else "default"


def quota(limit: Fraction) -> tuple[int, int]:
    """``(q, w)``: the limit as whole tokens per whole seconds, exactly (the
    draft's quota and window are integers): 40 tok/s is q=40;w=1, 0.5 tok/s
    q=1;w=2."""
    return limit.numerator, limit.denominator


def _sf_string(value: str) -> str:
    """A structured-field string (RFC 8941): printable ASCII, quoted."""
    clean = "".join(c if " " <= c <= "~" else "_" for c in value)
    return '"' + clean.replace("\\", "\\\\").replace('"', '\\"') + '"'


def ratelimit_headers(limit: Fraction, tier: str | None, listed: bool, ready_in_s: float,
                      prompt_rate: Fraction | None = None,
                      prompt_ready_in_s: float = 0.0) -> list[tuple[bytes, bytes]]:
    """``RateLimit-Policy`` and ``RateLimit`` for a caller whose budget
    allows ``limit`` tok/s and is ``ready_in_s`` seconds behind (0: it can
    take a token now):

    ``RateLimit-Policy: "gold";q=1000;w=1;qu="output-tokens"``
    ``RateLimit: "gold";r=1000;t=0``

    ``r``: output tokens the budget still allows over the next ``w``
    seconds; ``t``: seconds (rounded up) until it allows a full ``q`` again.
    With a prompt budget (``prompt_rate`` prompt tokens per second,
    ``prompt_ready_in_s`` behind), a second policy in both fields, named
    after the first (``PROMPT_POLICY_SUFFIX``):

    ``RateLimit-Policy: "gold";q=1000;w=1;qu="output-tokens",
    "gold-prompt";q=4000;w=1;qu="prompt-tokens"``"""
    name = policy_name(tier, listed)
    policies, states = _policy(_sf_string(name), limit, ready_in_s, QUOTA_UNIT)
    if prompt_rate is not None:
        more = _policy(_sf_string(name + PROMPT_POLICY_SUFFIX), prompt_rate, prompt_ready_in_s,
                       PROMPT_QUOTA_UNIT)
        policies, states = f"{policies}, {more[0]}", f"{states}, {more[1]}"
    return [(b"ratelimit-policy", policies.encode()), (b"ratelimit", states.encode())]


def _policy(name: str, limit: Fraction, ready_in_s: float, unit: str) -> tuple[str, str]:
    """One policy's items of ``RateLimit-Policy`` and ``RateLimit``."""
    q, w = quota(limit)
    behind = max(0.0, float(ready_in_s))
    remaining = max(0, math.floor((w - behind) * q / w + 1e-9)) if behind else q
    return f'{name};q={q};w={w};qu="{unit}"', f"{name};r={remaining};t={math.ceil(behind)}"


def limit_fraction(value: float | Fraction | int) -> Fraction:
    """A limit read back from a JSON number, exact for a decimal limit."""
    if isinstance(value, Fraction):
        return value
    return Fraction(repr(float(value)))
