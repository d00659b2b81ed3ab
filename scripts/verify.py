"""Engine-side ITL verification: see vllm_patch/verify.py (`vllm-output-rate verify`)."""

import sys

from vllm_patch.verify import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
