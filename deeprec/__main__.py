"""`python -m deeprec ...` (and `torchrun -m deeprec ...`): the deeprec CLI."""
import sys

from deeprec.cli import main

if __name__ == "__main__":
    sys.exit(main())
