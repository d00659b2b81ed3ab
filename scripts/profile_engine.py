"""py-spy schedule-cost report: see vllm_patch/profile.py (``vllm-output-rate profile``).

(Not named ``profile.py``: that would shadow the standard library's
``profile`` module, which cProfile imports, for every script in this folder.)
"""

import sys

from vllm_patch.profile import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
