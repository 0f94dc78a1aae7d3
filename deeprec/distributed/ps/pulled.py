"""The rows of each client's last training pull, kept for its push (ShardState's).

A worker pushes the keys it pulled, and an arena's rows stay put until a Load, so a push of
exactly those keys takes the rows the pull found instead of looking its keys up again. A push
may say so without sending the keys at all ("pulled": the seq of that pull): the keyless push,
0.1 MB less per step on the wire and no key checks. Either way the rows applied are the ones a
lookup of the keys would find, so the math is the same.
"""
from __future__ import annotations

import collections

import torch

from deeprec.distributed.ps.wire import WireError

PULLED = 64  # clients whose last training pull's rows are kept for their push (the least recent forgotten)


class PullNotHeld(WireError):
    """A keyless push whose pull this PS does not hold (a Load, another pull of the client or the
    LRU since): NOT_FOUND, nothing changed; the client sends the push again with its keys."""


class PulledRows:
    """client -> (generation, seq, names, [(part, (rows, repeated))]) of its last training pull."""

    def __init__(self):
        self._held: collections.OrderedDict[str, tuple] = collections.OrderedDict()

    def remember(self, client: str, generation: int, seq, names: list, parts: list, found: list) -> None:
        self._held[client] = (generation, seq, names, list(zip(parts, found)))
        self._held.move_to_end(client)
        while len(self._held) > PULLED:
            self._held.popitem(last=False)

    def clear(self) -> None:
        self._held.clear()

    def take(self, client, parts: list, generation: int) -> list | None:
        """(rows, repeated) of each part, as `client`'s last training pull found them, when this push
        is of exactly its keys (and no Load came since); else None (the push looks its keys up)."""
        held = self._held.pop(client, None) if isinstance(client, str) else None
        if held is None or held[0] != generation or len(held[3]) != len(parts):
            return None
        for p, (q, _) in zip(parts, held[3]):
            if p.arena is not q.arena or not torch.equal(p.keys, q.keys) or not torch.equal(p.ns, q.ns):
                return None
        return [found for _, found in held[3]]

    def keyless(self, client, seq: int, names: list, generation: int) -> tuple[list, list]:
        """(parts, (rows, repeated) of each) of pull `seq` of `client`, for a push without keys.
        Left held until `drop`: the push is checked whole before anything changes."""
        if not isinstance(client, str):
            raise WireError("Push: a push without keys ('pulled') must name its client (the one that pulled)")
        held, who = self._held.get(client), f"client {client[:8]}"
        if held is None or held[0] != generation or held[1] != seq:
            why = "none of its pulls" if held is None else (
                "a Load came since" if held[0] != generation else f"its last pull is {held[1]}")
            raise PullNotHeld(f"Push: the keyless push of {who} refers to its pull {seq}, which this PS does not "
                              f"hold ({why}): send the keys")
        if held[2] != names:
            raise WireError(f"Push: 'embeddings' must name the variables of pull {seq} ({', '.join(held[2])}) "
                            f"for a push without keys, got {', '.join(names) or 'none'}")
        return [p for p, _ in held[3]], [found for _, found in held[3]]

    def drop(self, client) -> None:
        self._held.pop(client, None)
