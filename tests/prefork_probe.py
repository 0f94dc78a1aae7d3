"""What a process sees at its start, as one JSON line (tests/test_prefork.py compares a forked one with an
exec'd one). argv: [exit code | "raise" | "interrupt"]."""
import json
import os
import random
import sys

import torch


def main() -> None:
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "probe": os.environ.get("PROBE"),
                      "threads": torch.get_num_threads(), "torch_first": torch.rand(1).item(),
                      "name": __name__, "stdout_tty": sys.stdout.isatty(),
                      "main_module": sys.modules["__main__"].__name__,
                      "random": random.random()}), flush=True)
    print("to stderr", file=sys.stderr)
    what = sys.argv[1] if len(sys.argv) > 1 else "0"
    if what == "raise":
        raise ValueError("probe failed")
    if what == "interrupt":
        raise KeyboardInterrupt
    if what == "wait":
        sys.stdin.readline()
    sys.exit(int(what))


if __name__ == "__main__":
    main()
