"""py-spy schedule-cost report: see vllm_patch/profile.py (``vllm-output-rate profile``)."""

import sys
from pathlib import Path

# This file's name shadows the standard library's ``profile`` module (which
# cProfile imports) for everything run from this directory: take it off the path.
_here = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != _here]

from vllm_patch.profile import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
