"""Load generator: see vllm_patch/loadgen.py (`vllm-output-rate loadgen`)."""

import sys

from vllm_patch.loadgen import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
