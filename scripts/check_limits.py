"""``vllm-output-rate check-limits``: a limits file (and API / admin keys
files) checked offline by the engine's own parsers, for CI and pre-commit.

``vllm-output-rate check-limits FILE... [--api-keys FILE] [--admin-keys FILE]``
exits 0 when every file is valid and 1 otherwise, printing each error found
(``FILE:LINE: KEY: what, got VALUE``), keys given twice included. The checks
are those of a running engine (``config.parse_limits_document``,
``frontend.parse_api_keys``): a file this accepts, the engine loads; one it
refuses, the engine refuses too (``OutputRateLimitsReloadFailed``).
``--schema`` prints the limits file's JSON Schema (``limits_file.schema``).

Not checked here, as it depends on the engine: with
``--output-rate-shared-state`` and without chunked prefill, an engine
refuses prompt budgets (``prompt_rate``).
"""

from __future__ import annotations

import argparse
import json
import sys

from vllm_output_rate.config import ConfigFileError, OutputRateConfig, OutputRateConfigError


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="vllm-output-rate check-limits",
        description="Check limits files (and API / admin keys files) with the engine's own "
                    "parsers: exit 0 when valid, 1 naming each error's file, line, key and value.")
    parser.add_argument("files", nargs="*", metavar="FILE",
                        help="limits files (YAML or JSON), as --output-rate-limits-file takes")
    parser.add_argument("--api-keys", action="append", default=[], metavar="FILE",
                        help="an API keys file, as --output-rate-api-keys takes (repeatable)")
    parser.add_argument("--admin-keys", action="append", default=[], metavar="FILE",
                        help="an admin keys file, as --output-rate-admin-keys takes (repeatable)")
    parser.add_argument("--schema", action="store_true",
                        help="print the limits file's JSON Schema and exit")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="print errors only, nothing for a valid file")
    args = parser.parse_args(argv)
    if not (args.schema or args.files or args.api_keys or args.admin_keys):
        parser.error("give a limits file, --api-keys, --admin-keys or --schema")
    return args


def _errors(exc: OutputRateConfigError) -> list[str]:
    return exc.errors if isinstance(exc, ConfigFileError) else [str(exc)]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise OutputRateConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def _summary(config: OutputRateConfig) -> str:
    return (f"default {config.default_rate} tok/s, {len(config.tiers)} tier(s), "
            f"{len(config.user_rates)} user(s)" + (", borrowing" if config.borrowing else ""))


def check(files: list[str], api_keys: list[str], admin_keys: list[str]) -> tuple[list[str], list[str]]:
    """(errors, one line per valid file)."""
    from vllm_output_rate.config import parse_limits_document
    from vllm_output_rate.frontend import parse_api_keys

    errors: list[str] = []
    valid: list[str] = []
    for path in files:
        try:
            valid.append(f"{path}: valid ({_summary(parse_limits_document(_read(path), path))})")
        except OutputRateConfigError as exc:
            errors += _errors(exc)
    for kind, paths in (("API keys", api_keys), ("admin keys", admin_keys)):
        for path in paths:
            try:
                valid.append(f"{path}: valid ({kind}: {len(parse_api_keys(_read(path), path))})")
            except OutputRateConfigError as exc:
                errors += _errors(exc)
    return errors, valid


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.schema:
        from vllm_output_rate.limits_file import schema

        print(json.dumps(schema(), indent=2))
        return 0
    errors, valid = check(args.files, args.api_keys, args.admin_keys)
    if not args.quiet:
        for line in valid:
            print(line)
    for line in errors:
        print(line, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
