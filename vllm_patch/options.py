"""The plugin's options: the group ``OutputRate`` it adds to vLLM's own
argument parser (``add_output_rate_args``), read by ``plugin`` into the
engine's configuration. ``vllm-output-rate serve --help=OutputRate`` lists
them; ``gen_docs`` writes docs/settings.md from this parser.
"""

from __future__ import annotations

from typing import Any

from vllm_output_rate import access, frontend, user_label
from vllm_output_rate.config import (
    OutputRateConfig,
    DEFAULT_OPTION,
    DEFAULT_OPTION_ALIAS,
    LIMITS_FILE_OPTION,
    PREFILL_AHEAD_OPTION,
    PROMPT_OPTION,
    PROMPT_OPTION_ALIAS,
    SHARED_STATE_OPTION,
    UNLISTED_MODES,
    UNLISTED_OPTION,
    USERS_OPTION,
    USERS_OPTION_ALIAS,
)
from vllm_output_rate.request_fields import USER_SOURCES_OPTION

#: The title of the options' group: one token, as vLLM names its groups
#: (``ModelConfig``), so that ``serve --help=OutputRate`` lists them all.
GROUP_TITLE = "OutputRate"


def add_output_rate_args(parser: Any) -> Any:
    """Add the output-rate options (the group ``GROUP_TITLE``) to a vLLM
    argument parser (once)."""
    if any(DEFAULT_OPTION in a.option_strings for a in parser._actions):
        return parser
    group = parser.add_argument_group(
        title=GROUP_TITLE,
        description="Per-user output-token rate limits inside the scheduler "
        "(vllm-output-rate).\n\nThe user is vllm_xargs.output_rate_user of each "
        f"request (or the fields of {USER_SOURCES_OPTION}; none: the shared user "
        "__anonymous__), unless a trusted header or API key names it.",
    )
    group.add_argument(
        DEFAULT_OPTION, DEFAULT_OPTION_ALIAS,
        dest="default_user_output_tokens_per_second",
        metavar="TOKENS_PER_S",
        default=None,
        type=str,
        help="Output tokens per second for each user without an override, "
        "shared by all of that user's requests. Setting it turns the feature "
        "on; without it vLLM behaves exactly as upstream.",
    )
    group.add_argument(
        USERS_OPTION, USERS_OPTION_ALIAS,
        dest="user_output_tokens_per_second",
        metavar="JSON",
        default=None,
        type=str,
        help='Per-user overrides as a JSON object, e.g. \'{"user-a": 100, '
        '"user-b": 0.5}\'.',
    )
    group.add_argument(
        PROMPT_OPTION, PROMPT_OPTION_ALIAS,
        dest="default_user_prompt_tokens_per_second",
        metavar="TOKENS_PER_S",
        default=None,
        type=str,
        help="Prompt tokens computed per second for each user (prefix-cache hits "
        "are free): a user's prefill chunks are shrunk to its budget, or wait, "
        "never refused. Off by default; a limits file sets it per user as "
        "{rate: R, prompt_rate: P}.",
    )
    group.add_argument(
        PREFILL_AHEAD_OPTION,
        dest="output_rate_prefill_ahead",
        action="store_true",
        default=False,
        help="Compute the prompts of users out of output budget ahead of it (their "
        "first token then waits in the KV cache). Off: a prompt is computed just "
        "in time, when its user has budget, so a throttled user's prompts never "
        "lengthen the others' steps; only that user's first token comes later.",
    )
    group.add_argument(
        LIMITS_FILE_OPTION,
        dest="output_rate_limits_file",
        metavar="FILE",
        default=None,
        type=str,
        help="A YAML or JSON file of limits: 'default' (tok/s of users not "
        "listed), 'tiers' (name -> tok/s) and 'users' (user -> tok/s or a tier "
        "name). Turns the feature on, instead of the two options above. The "
        "engine re-reads it when it changes (within a second) and on SIGHUP; "
        "a file that fails the checks changes nothing and is counted.",
    )
    group.add_argument(
        UNLISTED_OPTION,
        dest="output_rate_unlisted_users",
        default=None,
        choices=UNLISTED_MODES,
        help="Users not listed in the limits: 'own' (default) gives each its "
        "own default budget; 'shared' gives all of them one default budget "
        "(user __unlisted__), so that inventing new user ids gains nothing.",
    )
    group.add_argument(
        SHARED_STATE_OPTION,
        dest="output_rate_shared_state",
        metavar="URL",
        default=None,
        type=str,
        help="redis://HOST:PORT[/DB]: keep each user's budget in this Redis (or "
        "Valkey), shared by every engine that names it, so a user's limit holds "
        "across replicas and data-parallel ranks; redis-cluster://HOST:PORT[,HOST:PORT...]: "
        "in a Redis Cluster, each user on one slot. Engines lease slices of the "
        "budgets from a background thread; when the store (or a shard) is unreachable each "
        "engine gives a user its limit divided by the engines last seen sharing "
        "it. Query settings: tick_ms, horizon_ms, lookahead_ms, timeout_ms, slice_ms "
        "(long slices for steady users: fewer store entries, a wider fleet bound).",
    )
    group.add_argument(
        frontend.HEADER_OPTION,
        dest="output_rate_user_header",
        metavar="HEADER",
        default=None,
        type=str,
        help="Take the user from this request header (set by a gateway that "
        "authenticated the caller, e.g. X-User-Id); the body fields are then "
        "ignored. A request without it is the anonymous user.",
    )
    group.add_argument(
        frontend.REQUIRE_OPTION,
        dest="output_rate_require_user",
        action="store_true",
        default=False,
        help=f"Refuse requests without the {frontend.HEADER_OPTION} header (HTTP 401).",
    )
    group.add_argument(
        frontend.API_KEYS_OPTION,
        dest="output_rate_api_keys",
        metavar="FILE",
        default=None,
        type=str,
        help="A YAML/JSON file 'keys: {SHA-256 hex of an API key: user}': the "
        "request's bearer key decides the user, an unknown key gets HTTP 401. "
        "Keys of vLLM's --api-key stay valid as service keys (their user comes "
        "from the header option or the body). Reloaded when it changes.",
    )
    group.add_argument(
        access.ADMIN_KEYS_OPTION,
        dest="output_rate_admin_keys",
        metavar="FILE",
        default=None,
        type=str,
        help="Operators' keys, in the format of --output-rate-api-keys (reloaded the "
        "same way): besides vLLM's --api-key keys, they read every user's state and "
        "the limits under /output-rate/. They are no keys for /v1.",
    )
    group.add_argument(
        access.INTROSPECTION_OPTION,
        dest="output_rate_introspection",
        default=None,
        choices=access.INTROSPECTION_MODES,
        help="Who reads /output-rate/: 'own' (default with keys: a listed key reads "
        "only its own user's state, operator keys read all), 'operators' (operator "
        "keys only) or 'off' (closed). A server without keys leaves them open.",
    )
    group.add_argument(
        USER_SOURCES_OPTION,
        dest="output_rate_user_sources",
        metavar="FIELDS",
        default=None,
        type=str,
        help="The request fields the user is read from, comma-separated, the first "
        "one a request fills deciding: vllm_xargs (vllm_xargs.output_rate_user, the "
        "default) and user (the OpenAI API's user field, as the OpenAI SDK and LiteLLM "
        "send it), e.g. vllm_xargs,user. A trusted header or API key still decides "
        "over every body field.",
    )
    group.add_argument(
        user_label.LABEL_OPTION,
        dest="output_rate_user_label",
        default=None,
        choices=user_label.MODES,
        help="How a user's id shows in the per-user 'user' label of /metrics and on "
        "spans: 'raw' (default), 'hashed' (a stable salted hash; needs "
        f"{user_label.SALT_OPTION}) or 'off' (no per-user series, only totals).",
    )
    group.add_argument(
        user_label.SALT_OPTION,
        dest="output_rate_user_label_salt_file",
        metavar="FILE",
        default=None,
        type=str,
        help="A file holding the secret salt (at least 16 bytes) of hashed user labels.",
    )
    return parser


def config_from_args(args: Any) -> OutputRateConfig | None:
    """The limits the parsed options set (None: the feature off); raises
    ``OutputRateConfigError`` naming the option and the value."""
    return OutputRateConfig.from_options(
        getattr(args, "default_user_output_tokens_per_second", None),
        getattr(args, "user_output_tokens_per_second", None),
        getattr(args, "output_rate_limits_file", None),
        getattr(args, "output_rate_unlisted_users", None),
        getattr(args, "output_rate_shared_state", None),
        getattr(args, "default_user_prompt_tokens_per_second", None),
        bool(getattr(args, "output_rate_prefill_ahead", False)),
    )


def precheck(argv: list[str]) -> None:
    """The limits options of a ``serve`` command line checked before vLLM is
    imported (a refused file or value ends the command in a second, not
    after vLLM's imports); raises ``OutputRateConfigError``. Only the spelled
    options are read (no abbreviations, no ``--config`` file: those are
    checked where vLLM parses them, as before)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_output_rate_args(parser)
    try:
        args, _ = parser.parse_known_args(argv)
    except SystemExit:  # an option without its value: vLLM's parser says so
        return
    config_from_args(args)
