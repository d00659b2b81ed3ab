"""How a user's id appears in what the engine exports: the ``user`` label on
``/metrics`` and the ids on spans.

``--output-rate-user-label`` (setting ``OUTPUT_RATE_USER_LABEL``):

``raw`` (the default)
    The id itself (sanitized and capped by ``telemetry.labels``).
``hashed``
    ``u-`` and 16 hex digits of HMAC-SHA-256(salt, id): stable for a given
    salt (dashboards still group by user, a restart keeps the series), and
    whoever scrapes ``/metrics`` or reads the spans learns no id. The salt
    is the content of ``--output-rate-user-label-salt-file``
    (``OUTPUT_RATE_USER_LABEL_SALT_FILE``); keep it secret (a known salt
    lets anyone test guessed ids). An operator maps a known id to its label
    with ``hashed(id, salt)`` (docs/observability.md shows the one-liner).
``off``
    No per-user series: every user counts under ``__other__`` (the totals
    stay exact), and spans carry no user id.

Placeholders (``__anonymous__``, ``__unlisted__``) are no one's id and stay
as they are. The serving process checks the option at start-up (a bad mode,
a salt file missing, unreadable or empty: refused naming the option and
the value) and hands it to the engine core through the environment
(``settings.child_env``), as the other settings of the engine travel.

Pure logic and a file read: imports nothing from vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from typing import Any

from vllm_output_rate import settings
from vllm_output_rate.config import ANONYMOUS_USER, UNLISTED_USER, OutputRateConfigError

logger = logging.getLogger("vllm_output_rate")

LABEL_OPTION = "--output-rate-user-label"
SALT_OPTION = "--output-rate-user-label-salt-file"
MODES = ("raw", "hashed", "off")
#: ids that are no one's: never hashed
PLACEHOLDERS = (ANONYMOUS_USER, UNLISTED_USER)
#: a salt shorter than this is refused (too easy to guess)
MIN_SALT_BYTES = 16


@dataclass(frozen=True)
class UserLabelPolicy:
    mode: str = "raw"
    salt: bytes = b""

    def public_id(self, user: str) -> str | None:
        """What may be shown of ``user``: itself, its salted hash, or None
        (``off``: nothing)."""
        if self.mode == "raw" or user in PLACEHOLDERS:
            return user
        if self.mode == "off":
            return None
        return hashed(user, self.salt)


RAW = UserLabelPolicy()


def hashed(user: str, salt: bytes) -> str:
    digest = hmac.new(salt, user.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return "u-" + digest.hexdigest()[:16]


def read_salt(path: str, where: str) -> bytes:
    """The salt file's bytes (surrounding whitespace dropped); raises
    ``OutputRateConfigError`` naming ``where`` and the file."""
    try:
        with open(path, "rb") as f:
            salt = f.read().strip()
    except OSError as exc:
        raise OutputRateConfigError(
            f"{where} {path}: cannot read it ({exc.strerror or exc})") from None
    if len(salt) < MIN_SALT_BYTES:
        raise OutputRateConfigError(
            f"{where} {path}: a salt of at least {MIN_SALT_BYTES} bytes is needed, the file "
            f"holds {len(salt)} (make one with: head -c 32 /dev/urandom | base64 > FILE)")
    return salt


def check_options(mode: Any, salt_file: Any) -> UserLabelPolicy:
    """The policy the options (or, when an option is not given, the
    settings) ask for, checked. Raises ``OutputRateConfigError`` naming the
    option and the value."""
    if mode is None:
        try:
            mode = settings.get("USER_LABEL")
        except settings.SettingError as exc:
            raise OutputRateConfigError(str(exc)) from None
        where_mode = settings.name("USER_LABEL")
    else:
        where_mode = LABEL_OPTION
    if mode not in MODES:
        raise OutputRateConfigError(
            f"{where_mode}: expected one of {', '.join(MODES)}, got {mode!r}")
    where_salt = SALT_OPTION
    if salt_file in (None, ""):
        salt_file, where_salt = settings.get("USER_LABEL_SALT_FILE"), settings.name(
            "USER_LABEL_SALT_FILE")
    if mode != "hashed":
        if salt_file and where_salt == SALT_OPTION:
            raise OutputRateConfigError(
                f"{SALT_OPTION} {salt_file}: a salt is only used with {LABEL_OPTION} hashed "
                f"(got {mode})")
        return UserLabelPolicy(mode)
    if not salt_file:
        raise OutputRateConfigError(
            f"{where_mode} hashed needs a salt: {SALT_OPTION} FILE (or "
            f"{settings.name('USER_LABEL_SALT_FILE')})")
    return UserLabelPolicy(mode, read_salt(str(salt_file), where_salt))


def child_settings(mode: Any, salt_file: Any) -> dict[str, str]:
    """The environment entries that carry the options to the engine core
    (``settings.child_env``); empty when neither option is given."""
    import os

    values: dict[str, Any] = {}
    if mode is not None:
        values["USER_LABEL"] = mode
    if salt_file:
        values["USER_LABEL_SALT_FILE"] = os.path.abspath(str(salt_file))
    return settings.child_env(**values) if values else {}


#: (the settings' raw values it was made from, the policy)
_policy: tuple[tuple[str | None, str | None], UserLabelPolicy] | None = None


def current() -> UserLabelPolicy:
    """The policy of this process (the engine core's telemetry and spans),
    from the settings: made once for their values (two environment reads a
    call: called per label and per span, never per token). A setting that
    cannot be used (the salt file gone since start-up) turns the ids off,
    logged, never raw."""
    global _policy
    key = (os.environ.get(settings.name("USER_LABEL")),
           os.environ.get(settings.name("USER_LABEL_SALT_FILE")))
    if _policy is None or _policy[0] != key:
        try:
            policy = check_options(None, None)
        except OutputRateConfigError as exc:
            logger.error("output-rate: %s; user ids are left out of metrics and spans", exc)
            policy = UserLabelPolicy("off")
        _policy = (key, policy)
    return _policy[1]


def forget() -> None:
    """Read the settings again at the next ``current()`` (tests, tools)."""
    global _policy
    _policy = None
