"""`python -m deeprec.distributed --bind HOST:PORT --shard I --num-shards N`: run one PS shard."""
import sys

from deeprec.distributed.ps_shard import main

sys.exit(main())
