"""EmbeddingVariable options, with DeepRec's names and defaults."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from deeprec.choices import CACHE_POLICIES, STORAGES
from deeprec.errors import ConfigError
from deeprec.options import check_fields, option, parse_bytes


@dataclass
class InitializerOption:
    """A new key's row is row `key % default_value_dim` of a fixed initializer
    matrix, so a key always starts from the same values (reproducible via `seed`).
    `default_value_no_permission` is what a key not yet admitted by a filter reads."""

    initializer: Callable[[torch.Tensor], object] | None = None  # in-place init; default N(0, 1/dim) truncated
    default_value_dim: int = 4096
    default_value_no_permission: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.default_value_dim < 1:
            raise ConfigError(f"default_value_dim must be >= 1, got {self.default_value_dim}")

    def matrix(self, dim: int) -> torch.Tensor:
        m = torch.empty(self.default_value_dim, dim)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            if self.initializer is None:
                torch.nn.init.trunc_normal_(m, std=1.0 / math.sqrt(dim), a=-2.0 / math.sqrt(dim),
                                            b=2.0 / math.sqrt(dim))
            else:
                self.initializer(m)
        return m


@dataclass
class CounterFilter:
    """Admit a key after `filter_freq` sightings (an exact count per pending key)."""

    filter_freq: int

    def __post_init__(self):
        if self.filter_freq < 1:
            raise ConfigError(f"CounterFilter.filter_freq must be >= 1, got {self.filter_freq}")


@dataclass
class CBFFilter:
    """Counting Bloom filter admission: bounded memory, may admit a key early
    with probability about `false_positive_probability`."""

    filter_freq: int
    max_element_size: int = 2**20
    false_positive_probability: float = 0.01
    counter_type: torch.dtype = torch.int64

    def __post_init__(self):
        if self.filter_freq < 1:
            raise ConfigError(f"CBFFilter.filter_freq must be >= 1, got {self.filter_freq}")
        if not 0 < self.false_positive_probability < 1:
            raise ConfigError("CBFFilter.false_positive_probability must be in (0, 1)")

    def sizing(self) -> tuple[int, int]:
        """(counters, hash functions) for the element count and error rate."""
        m = math.ceil(-self.max_element_size * math.log(self.false_positive_probability) / math.log(2) ** 2)
        k = max(1, round(m / self.max_element_size * math.log(2)))
        return m, k


@dataclass
class GlobalStepEvict:
    """At save time, drop keys not updated in the last `steps_to_live` steps."""

    steps_to_live: int


@dataclass
class L2WeightEvict:
    """At save time, drop keys whose 0.5 * sum(w^2) is below the threshold."""

    l2_weight_threshold: float


TIERS = (("dram",), ("dram", "ssd"))


@dataclass
class StorageOption:
    """Where EmbeddingVariable rows live (DeepRec's StorageOption / CacheStrategy): all in DRAM, or a
    DRAM cache over a disk tier. Also the `storage` section of `deeprec train` and the flags of a PS
    shard (`python -m deeprec.distributed.ps --storage ssd --dram-bytes N`)."""

    tiers: list[str] = option(factory=lambda: ["dram"], flag="--storage", choices=STORAGES, nargs=None,
                              parse=lambda v: ["dram", "ssd"] if v == "ssd" else ["dram"])
    """where EmbeddingVariable rows live: all in DRAM, or at most --dram-bytes of them in a DRAM cache over a
    disk tier in --storage-path (training: a model's EmbeddingVariables; zoo models: --embedding variable)"""
    dram_bytes: int | None = option(None, ge=1, parse=parse_bytes, metavar="BYTES")
    """--storage ssd: bytes of rows (values, optimizer slots) kept in DRAM (4096, 512M, 2G, 512MiB); in
    training shared evenly by the model's EmbeddingVariables, on a PS shard each variable's"""
    path: str | None = option(None, flag="--storage-path")
    """--storage ssd: folder of the disk tier (default: the temp folder)"""
    cache: str = option("lfu", choices=CACHE_POLICIES)
    """--storage ssd: rows that leave DRAM first, least frequently or recently used"""
    prefetch: bool = option(True, flag="--storage-prefetch")
    """--storage ssd with SmartStage: the stage moves the next batch's rows from disk into DRAM while the
    current batch trains"""
    protect_steps: int = option(4, cli=False, ge=1)
    """rows used by the last this many lookups are never evicted (their update may still be in flight)"""

    def __post_init__(self):
        check_fields(self, ("storage",))
        if tuple(self.tiers) not in TIERS:
            raise ConfigError(f"--storage (StorageOption.tiers={self.tiers!r}) is not allowed; choose one of "
                              f"{', '.join(str(list(t)) for t in TIERS)}")
        if self.tiered and self.dram_bytes is None:
            raise ConfigError("--storage ssd needs --dram-bytes (StorageOption.dram_bytes): the DRAM cache's "
                              "budget, e.g. --dram-bytes 512M")

    @property
    def tiered(self) -> bool:
        return "ssd" in self.tiers


@dataclass
class EmbeddingVariableOption:
    init_option: InitializerOption = field(default_factory=InitializerOption)
    filter_option: CounterFilter | CBFFilter | None = None
    evict_option: GlobalStepEvict | L2WeightEvict | None = None
    storage: StorageOption = field(default_factory=StorageOption)
