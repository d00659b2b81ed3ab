"""`make demo`: see vllm_patch/demo.py."""

from vllm_patch.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
