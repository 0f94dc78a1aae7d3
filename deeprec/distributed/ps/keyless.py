"""The client's side of the keyless push (the PS's: pulled.py).

A worker pushes the keys it just pulled. When the PS said, in the pull's reply, that it kept that
pull's rows (`"kept": its seq`), and no other call of this client reached that PS since, the push
sends no keys, only `"pulled": seq`. A PS that never says so (an older one, tiered storage) gets
keyed pushes only: no refused call and no second send. One the PS no longer holds (a Load, its
LRU) is refused with NOT_FOUND and sent again with its keys.
"""
from __future__ import annotations

import torch


class LastPulls:
    """Per PS: the latest pull or push sent to it, and the pull it kept, while still the latest.
    Called under the client's seq lock (threads of one client share it)."""

    def __init__(self, count: int):
        self._issued: list[int | None] = [None] * count
        self._kept: list[tuple | None] = [None] * count  # (seq, embeddings, keys, counts)

    def sent(self, method: str, ps: int, seq: int, header: dict, tensors: dict) -> tuple | None:
        """A numbered call to `ps`: a training pull gives its (seq, embeddings, keys, counts), to hand
        to `answered` with its reply; a push, the kept pull it may refer to (or None)."""
        if method == "Pull" and "embeddings" in header:
            self._issued[ps], self._kept[ps] = seq, None
            return seq, header["embeddings"], tensors.get("keys"), tensors.get("counts")
        if method in ("Push", "PushPull"):  # the PS forgets the pull's rows at any push
            last, self._kept[ps], self._issued[ps] = self._kept[ps], None, seq
            return last
        return None

    def answered(self, ps: int, pull: tuple, reply: dict) -> None:
        if reply.get("kept") == pull[0] and self._issued[ps] == pull[0]:
            self._kept[ps] = pull


def same_keys(last: tuple | None, header: dict, tensors: dict) -> bool:
    """Whether a push's keys are those of `last`, the kept pull (so the push may send none)."""
    if last is None or header.get("embeddings") != last[1] or "keys" not in tensors or last[2] is None:
        return False
    keys, counts = tensors["keys"], tensors.get("counts")
    return ((keys is last[2] or torch.equal(keys, last[2])) and counts is not None and last[3] is not None
            and torch.equal(counts, last[3]))
