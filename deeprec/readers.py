"""The training and evaluation readers of a TrainConfig: its files, held-out share, shards and
epochs, or a FollowReader watching for new files (--follow)."""
from __future__ import annotations

import zlib

from deeprec.data import open_reader
from deeprec.data.follow import FollowReader
from deeprec.errors import ConfigError, EmptyShardError
from deeprec.train_config import TrainConfig


def _holdout_shards(fraction: float) -> tuple[int, list[int], int]:
    """Split data into n byte-range shards: train on all but the last, evaluate on the last."""
    n = max(2, round(1.0 / fraction))
    return n, list(range(n - 1)), n - 1


def make_readers(cfg: TrainConfig, schema=None, drop_remainder: bool = False, train_shards: dict | None = None,
                 eval_shards: dict | None = None):
    """Training and evaluation readers; `*_shards`: this process's share ({shard_index, num_shards}).
    drop_remainder: training drops an epoch's short last batch (batch norm cannot train on one row)."""
    common = dict(seed=cfg.training.seed, on_bad_row=cfg.data.on_bad_row, schema=schema)
    epochs = None if cfg.training.steps is not None and not cfg.data.follow else (cfg.training.epochs or 1)
    train_kw = dict(shuffle_buffer=cfg.data.shuffle_buffer, num_epochs=epochs, drop_remainder=drop_remainder, **common,
                    **(train_shards or {}))
    eval_kw = dict(num_epochs=1, **common, **(eval_shards or {}))
    if cfg.data.follow:  # workers see new files at different times: each reads whole files of its own
        follow_kw = {k: v for k, v in train_kw.items() if k not in ("shard_index", "num_shards")}
        shard, shards = (train_shards or {}).get("shard_index", 0), (train_shards or {}).get("num_shards", 1)

        def open_files(files):
            return open_reader(files, cfg.data.batch_size, **follow_kw)

        train = FollowReader(cfg.data.paths, open_files, cfg.data.follow_interval,
                             owns=lambda path: zlib.crc32(path.encode()) % shards == shard)
        held_out = open_reader(cfg.data.eval_paths, cfg.data.eval_batch_size, **eval_kw) if cfg.data.eval_paths else None
        return train, held_out
    if cfg.data.eval_paths:
        return open_reader(cfg.data.paths, cfg.data.batch_size, **train_kw), open_reader(cfg.data.eval_paths, cfg.data.eval_batch_size, **eval_kw)
    if cfg.data.eval_fraction:
        n, train_shards, eval_shard = _holdout_shards(cfg.data.eval_fraction)
        train = open_reader(cfg.data.paths, cfg.data.batch_size, num_shards=n, shard_index=train_shards, **train_kw)
        try:  # checked when built: an empty held-out shard fails now, not after training
            held_out = open_reader(cfg.data.paths, cfg.data.eval_batch_size, num_shards=n, shard_index=eval_shard, **eval_kw)
        except EmptyShardError as err:
            fix = (f"use --eval-fraction >= {1 / err.max_shards:.2g} or --eval-data" if err.max_shards >= 2
                   else "use --eval-data")
            raise ConfigError(f"--eval-fraction {cfg.data.eval_fraction} holds out shard {eval_shard + 1} of {n} of "
                              f"{', '.join(err.paths)}, but the data gives at most {err.max_shards} shard(s) (Parquet: "
                              f"one per row group; text: byte ranges holding a row): {fix}") from None
        return train, held_out
    return open_reader(cfg.data.paths, cfg.data.batch_size, **train_kw), None
