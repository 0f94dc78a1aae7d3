"""`python -m deeprec.distributed.ps --bind HOST:PORT --shard I --num-shards N`: run one PS shard."""
import sys

from deeprec.distributed.ps.shard import main

sys.exit(main())
