"""EmbeddingVariable options, with DeepRec's names and defaults."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from deeprec.errors import ConfigError, check_choice


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
CACHE_POLICIES = ("lfu", "lru")


@dataclass
class StorageOption:
    """Where an EmbeddingVariable's rows live (DeepRec's StorageOption / CacheStrategy).

    tiers: ["dram"] (everything in memory), or ["dram", "ssd"]: at most `dram_bytes` of rows
    (values, optimizer slots, bookkeeping) in a DRAM cache, the others in a row file under
    `path` (default: the system's temporary directory). cache: which rows leave DRAM when it
    is full, the least frequently ("lfu") or least recently ("lru") used. prefetch: under
    SmartStage, move the next batch's rows into DRAM while the current batch trains.
    protect_steps: rows used by the last this many lookups are never evicted (their update
    may still be in flight)."""

    tiers: list[str] = field(default_factory=lambda: ["dram"])
    dram_bytes: int | None = None
    path: str | None = None
    cache: str = "lfu"
    prefetch: bool = True
    protect_steps: int = 4

    def __post_init__(self):
        if tuple(self.tiers) not in TIERS:
            raise ConfigError(f"StorageOption.tiers={self.tiers!r} is not allowed; choose one of "
                              f"{', '.join(str(list(t)) for t in TIERS)}")
        check_choice("StorageOption.cache", self.cache, CACHE_POLICIES)
        if self.tiered and (not isinstance(self.dram_bytes, int) or self.dram_bytes <= 0):
            raise ConfigError(f"StorageOption.dram_bytes must be a positive int with an ssd tier, got {self.dram_bytes!r}")
        if not isinstance(self.protect_steps, int) or self.protect_steps < 1:
            raise ConfigError(f"StorageOption.protect_steps must be an int >= 1, got {self.protect_steps!r}")

    @property
    def tiered(self) -> bool:
        return "ssd" in self.tiers


@dataclass
class EmbeddingVariableOption:
    init_option: InitializerOption = field(default_factory=InitializerOption)
    filter_option: CounterFilter | CBFFilter | None = None
    evict_option: GlobalStepEvict | L2WeightEvict | None = None
    storage: StorageOption = field(default_factory=StorageOption)
