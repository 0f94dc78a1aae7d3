"""Fake (meta) kernels of the C++ ops: output shapes and dtypes without data, so
torch.compile traces through the ops without a graph break and torch.export
captures them (FakeTensor mode calls these instead of the CPU kernels)."""
from __future__ import annotations

import torch


@torch.library.register_fake("deeprec::string_to_hash_bucket")
def _(values, offsets, num_buckets, hash):
    return [o.new_empty(o.shape[0] - 1) for o in offsets]


@torch.library.register_fake("deeprec::string_to_hash_key")
def _(values, offsets, hash):
    return [o.new_empty(o.shape[0] - 1) for o in offsets]


@torch.library.register_fake("deeprec::cross_hash_bucket")
def _(values, offsets, num_buckets, separator, hash):
    return offsets[0].new_empty(offsets[0].shape[0] - 1)


@torch.library.register_fake("deeprec::bucketize")
def _(x, boundaries):
    return x.new_empty(x.shape, dtype=torch.long)


@torch.library.register_fake("deeprec::dedup")
def _(ids):
    unique = ids.new_empty(torch.library.get_ctx().new_dynamic_size())
    return unique, ids.new_empty(ids.shape)


@torch.library.register_fake("deeprec::prepare_bags")
def _(values, offsets, batch, combiners, fill_ids, has_fill):
    ctx = torch.library.get_ctx()
    uniques = [v.new_empty(ctx.new_dynamic_size()) for v in values]
    total = ctx.new_dynamic_size()
    return [*uniques, values[0].new_empty(total), values[0].new_empty(len(values) * batch + 1),
            values[0].new_empty(total, dtype=torch.float32), *[u.new_empty(u.shape[0]) for u in uniques]]


@torch.library.register_fake("deeprec::key_index_find")
def _(tables, row_keys, freqs, ns, keys, counts, sizes, insert, dedup):
    ctx = torch.library.get_ctx()
    rows = [k.new_empty(ctx.new_dynamic_size() if dedup else k.shape[0]) for k in keys]
    inverse = [k.new_empty(k.shape[0] if dedup else 0) for k in keys]
    fresh = [k.new_empty(ctx.new_dynamic_size()) for k in keys]
    return rows, inverse, fresh, keys[0].new_empty(len(keys), 3)


@torch.library.register_fake("deeprec::ev_lookup")
def _(tables, row_keys, freqs, weights, versions, dirty, defaults, keys, counts, sizes, steps, no_permission,
      insert, dedup):
    ctx = torch.library.get_ctx()
    rows = [k.new_empty(ctx.new_dynamic_size() if dedup else k.shape[0]) for k in keys]
    inverse = [k.new_empty(k.shape[0] if dedup else 0) for k in keys]
    values = weights[0].new_empty(ctx.new_dynamic_size(), weights[0].shape[1])
    return values, rows, inverse, keys[0].new_empty(len(keys), 4)


@torch.library.register_fake("deeprec::key_index_assign")
def _(table, ns, keys, rows):
    return torch.library.get_ctx().new_dynamic_size()


@torch.library.register_fake("deeprec::key_index_remove")
def _(table, ns, keys):
    return torch.library.get_ctx().new_dynamic_size()


@torch.library.register_fake("deeprec::key_index_grow")
def _(table, old_slots):
    return None


@torch.library.register_fake("deeprec::key_index_entries")
def _(table):
    ctx = torch.library.get_ctx()
    n = ctx.new_dynamic_size()
    return table.new_empty(n), table.new_empty(n), table.new_empty(n)


@torch.library.register_fake("deeprec::ev_apply_")
def _(optimizer, weights, slots, versions, dirty, rows, grad, hyper, step):
    return None


@torch.library.register_fake("deeprec::sparse_sgd_")
def _(weight, rows, grad, lr):
    return None


@torch.library.register_fake("deeprec::sparse_adagrad_")
def _(weight, acc, rows, grad, lr, eps):
    return None


@torch.library.register_fake("deeprec::sparse_adam_")
def _(weight, exp_avg, exp_avg_sq, row_step, rows, grad, lr, beta1, beta2, eps, step):
    return None


@torch.library.register_fake("deeprec::ps_init_rows")
def _(fresh, ns, keys, start, row_ns, weight, version, step, slots, slot_values, defaults, offset, count):
    return None


@torch.library.register_fake("deeprec::ps_gather_rows")
def _(weight, rows, out):
    return None


@torch.library.register_fake("deeprec::ps_request_ns")
def _(keys, counts, ids, num_shards, shard, partition_mod):
    return keys.new_empty(keys.shape), keys.new_empty(3)


@torch.library.register_fake("deeprec::ps_finite_prefix")
def _(t):
    return torch.library.get_ctx().new_dynamic_size()


@torch.library.register_fake("deeprec::dot_interaction")
def _(x):
    n = x.shape[1]
    return x.new_empty(x.shape[0], n * (n - 1) // 2)


@torch.library.register_fake("deeprec::dot_interaction_backward")
def _(grad, x):
    return x.new_empty(x.shape)


@torch.library.register_fake("deeprec::linear_relu")
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.register_fake("deeprec::gather_rows")
def _(rows, index):
    return rows.new_empty(*index.shape, rows.shape[1])


@torch.library.register_fake("deeprec::gather_rows_backward")
def _(grad, index, num_rows):
    return grad.new_empty(num_rows, grad.shape[-1])
