"""`@op`: make a function a single, opaque node when `forward` is traced.

torch.fx traces through plain Python and fails on non-tensor work (hashing
strings, numpy). A function decorated with `@op` is recorded as one
`call_function` node instead, so graph passes can move it (e.g. SmartStage
puts it in the background stage) without looking inside. Unlike
`torch.fx.wrap`, this works however the function was imported.

An op returning several values declares how many (`outputs=`): traced, its result is then
a tuple of that many values (one getitem node each), so `for k in keys`, `zip(...)`
and `len(...)` work on it as on the eager result.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch.fx
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

__all__ = ["op", "is_op", "is_pure_op", "is_stateful_op"]


def _first_proxy(value: Any) -> torch.fx.Proxy | None:
    if isinstance(value, torch.fx.Proxy):
        return value
    if isinstance(value, (list, tuple)):
        items = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        return None
    for item in items:
        found = _first_proxy(item)
        if found is not None:
            return found
    return None


def op(fn: Callable | None = None, *, stateful: bool = False,
       outputs: int | Callable[..., int | None] | None = None, pure: bool = False):
    """Decorator: `@op`, `@op(stateful=True)`, `@op(outputs=2)`, `@op(pure=True)`.

    A stateful op (one that reads or writes state outside its arguments, such
    as a counter or a lookup into a growing table) is never moved ahead of
    the step that owns that state. `outputs`: how many values the op returns as a
    tuple, or a function of the op's arguments saying so (None: one value).
    `pure`: its result depends on its arguments alone (no state, no random numbers) and it
    writes none of them: two calls on the same inputs may be merged into one
    (deeprec/graph/shared_calls.py).
    """
    if pure and stateful:
        raise ValueError("@op: an op cannot be both pure and stateful")

    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            if not is_fx_symbolic_tracing():  # the common case, checked without walking the arguments
                return func(*args, **kwargs)
            proxy = _first_proxy((args, kwargs))
            if proxy is None:
                return func(*args, **kwargs)
            node = proxy.tracer.create_proxy("call_function", wrapper, args, kwargs)
            count = outputs(*args, **kwargs) if callable(outputs) else outputs
            return node if count is None else tuple(node[i] for i in range(count))

        wrapper.__deeprec_op__ = True
        wrapper.__deeprec_stateful__ = stateful
        wrapper.__deeprec_pure__ = pure
        return wrapper

    return decorate(fn) if fn is not None else decorate


def is_op(target: Any) -> bool:
    return bool(getattr(target, "__deeprec_op__", False))


def is_stateful_op(target: Any) -> bool:
    return bool(getattr(target, "__deeprec_stateful__", False))


def is_pure_op(target: Any) -> bool:
    return bool(getattr(target, "__deeprec_pure__", False))
