"""Synthetic behaviour logs (the `behavior` schema) with a planted preference.

Items have a category and a Zipf popularity; each user prefers a few
categories. A row is one impression: the user's history (up to max_length
earlier items, mostly from the preferred categories, oldest first) and a
target item. The click probability is

    sigmoid(-1.6 + 2.2 * [target category preferred] + 0.9 * [target category among
            the last 5 history categories] + 0.5 * item quality)

so a model that relates the target to the history (DIN's attention, DIEN's
interest evolution, DSSM's towers) reaches an AUC well above 0.5. `like` (a
second task for MMoE) is a click that the item's quality turned into a like.
Written as TSV with a header: click, like, user_id, item_id, category_id,
hist_items, hist_cats ("|"-separated).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from deeprec.progress import progress as show_progress


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


class BehaviorWorld:
    """Items (category, quality, Zipf popularity) and users (3 preferred categories)."""

    def __init__(self, users: int, items: int, categories: int, seed: int):
        rng = np.random.default_rng([seed, 7])
        self.users, self.items, self.categories = users, items, categories
        self.item_category = rng.integers(0, categories, items)
        self.item_quality = rng.normal(0.0, 1.0, items)
        popularity = (1.0 / np.arange(1, items + 1) ** 1.1)[rng.permutation(items)]
        self.cdf = np.cumsum(popularity) / popularity.sum()
        # items sorted by category; key = category + cdf within it, so one searchsorted
        # of (category + u) draws an item of that category by popularity
        self.by_category = np.argsort(self.item_category, kind="stable")
        cats = self.item_category[self.by_category]
        weights = popularity[self.by_category]
        within = np.zeros(items)
        for c in range(categories):
            ix = np.flatnonzero(cats == c)
            if len(ix):
                within[ix] = np.cumsum(weights[ix]) / weights[ix].sum()
        self.category_key = cats + within
        self.preferred = np.stack([rng.choice(categories, 3, replace=False) for _ in range(users)])

    def popular(self, rng, n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.cdf, rng.random(n)), self.items - 1)

    def in_category(self, rng, categories: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(self.category_key, categories + rng.random(len(categories)) * (1 - 1e-12))
        pos = np.minimum(pos, self.items - 1)
        found = self.item_category[self.by_category[pos]] == categories
        return np.where(found, self.by_category[pos], self.popular(rng, len(categories)))  # empty category


def _joined(values: np.ndarray, offsets: np.ndarray) -> pa.Array:
    lists = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values.astype(str)))
    return pc.binary_join(lists, "|")


def write_behavior(path: str, rows: int, *, users: int = 5000, items: int = 20000, categories: int = 100,
                   max_length: int = 50, seed: int = 0, sample_seed: int | None = None,
                   chunk_rows: int = 100_000, progress=None) -> dict:
    """`seed` fixes the world (items, users, preferences); `sample_seed` the rows drawn
    from it (default: seed), so a train and an eval file share one world. `progress`: rows written
    on a terminal (None or True: deeprec.progress's shared console, False: never, or a rich Console)."""
    world = BehaviorWorld(users, items, categories, seed)
    rng = np.random.default_rng([seed if sample_seed is None else sample_seed, 11])
    clicks = 0
    with pa.OSFile(path, "wb") as sink, show_progress("synth", total=rows, console=progress) as shown:
        sink.write(b"click\tlike\tuser_id\titem_id\tcategory_id\thist_items\thist_cats\n")
        options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
        for start in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - start)
            user = rng.integers(0, users, n)
            prefs = world.preferred[user]
            lengths = rng.integers(0, max_length + 1, n)
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            row = np.repeat(np.arange(n), lengths)
            pick = prefs[row, rng.integers(0, 3, len(row))]
            hist = np.where(rng.random(len(row)) < 0.8, world.in_category(rng, pick), world.popular(rng, len(row)))
            hist_cats = world.item_category[hist]
            target = np.where(rng.random(n) < 0.4, world.in_category(rng, prefs[np.arange(n), rng.integers(0, 3, n)]),
                              world.popular(rng, n))
            category = world.item_category[target]
            preferred = (prefs == category[:, None]).any(1)
            last5 = (offsets[1:][row] - np.arange(len(row))) <= 5
            recent = np.bincount(row[last5 & (hist_cats == category[row])], minlength=n) > 0
            quality = world.item_quality[target]
            click = rng.random(n) < _sigmoid(-1.6 + 2.2 * preferred + 0.9 * recent + 0.5 * quality)
            like = click & (rng.random(n) < _sigmoid(quality - 0.5))
            clicks += int(click.sum())
            table = pa.table({"click": click.astype(np.int8), "like": like.astype(np.int8), "user_id": user,
                              "item_id": target, "category_id": category, "hist_items": _joined(hist, offsets),
                              "hist_cats": _joined(hist_cats, offsets)})
            pacsv.write_csv(table, sink, write_options=options)
            shown.advance(n)
    return {"rows": rows, "click_rate": clicks / max(rows, 1), "users": users, "items": items,
            "categories": categories}
