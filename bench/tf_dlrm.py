"""TensorFlow peer of bench/e2e.py and bench/step.py: tf.data (TextLineDataset, decode_csv,
to_hash_bucket_fast, prefetch) feeding a Keras DLRM, DeepFM or WDL of the modelzoo sizes (as
deeprec/models/), Adagrad. Runs in its own venv:

    make bench-tf-venv        # .venv-tf with tensorflow-cpu 2.21
    .venv-tf/bin/python bench/tf_dlrm.py --data FILE --steps 300 [--jit] [--model deepfm]

Prints one JSON line: samples/s over the steps after the warm-up.
"""
import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

DENSE, SPARSE = 13, 26


def dataset(path: str, batch: int, buckets: int) -> tf.data.Dataset:
    defaults = [[0.0]] * (1 + DENSE) + [[""]] * SPARSE

    def parse(lines):
        cols = tf.io.decode_csv(lines, defaults, field_delim="\t")
        dense = tf.math.log1p(tf.maximum(tf.stack(cols[1:1 + DENSE], axis=1), 0.0))
        ids = tf.stack([tf.strings.to_hash_bucket_fast(c, buckets) for c in cols[1 + DENSE:]], axis=1)
        return (dense, ids), cols[0]

    return (tf.data.TextLineDataset(path).repeat().batch(batch, drop_remainder=True)
            .map(parse, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE))


class DLRM(tf.keras.Model):
    def __init__(self, buckets: int, dim: int = 16):
        super().__init__()
        self.tables = [tf.keras.layers.Embedding(buckets, dim, embeddings_initializer=
                                                 tf.keras.initializers.RandomUniform(-0.05, 0.05)) for _ in range(SPARSE)]
        self.bottom = tf.keras.Sequential([tf.keras.layers.Dense(w, activation="relu") for w in (512, 256, 64)] +
                                          [tf.keras.layers.Dense(dim, activation="relu")])
        self.top = tf.keras.Sequential([tf.keras.layers.Dense(w, activation="relu") for w in (512, 256)] +
                                       [tf.keras.layers.Dense(1)])
        n = SPARSE + 1
        self.pairs = [(i, j) for i in range(n) for j in range(i)]

    def call(self, inputs):
        dense, ids = inputs
        x = self.bottom(dense)
        vectors = tf.stack([x] + [t(ids[:, f]) for f, t in enumerate(self.tables)], axis=1)
        dots = tf.linalg.matmul(vectors, vectors, transpose_b=True)
        rows, cols = zip(*self.pairs)
        flat = tf.gather(tf.reshape(dots, [-1, (SPARSE + 1) ** 2]), [r * (SPARSE + 1) + c for r, c in self.pairs], axis=1)
        return tf.squeeze(self.top(tf.concat([x, flat], axis=1)), 1)


def _tables(buckets: int, dim: int) -> list:
    return [tf.keras.layers.Embedding(buckets, dim, embeddings_initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05))
            for _ in range(SPARSE)]


def _mlp(widths, out: bool = True) -> tf.keras.Sequential:
    return tf.keras.Sequential([tf.keras.layers.Dense(w, activation="relu") for w in widths] +
                               ([tf.keras.layers.Dense(1)] if out else []))


class DeepFM(tf.keras.Model):
    """deeprec/models/deepfm.py: first order + FM over the embeddings + DNN 1024-256-32."""

    def __init__(self, buckets: int, dim: int = 16):
        super().__init__()
        self.tables, self.weights_1 = _tables(buckets, dim), _tables(buckets, 1)
        self.dense_linear, self.dnn = tf.keras.layers.Dense(1), _mlp((1024, 256, 32))

    def call(self, inputs):
        dense, ids = inputs
        vectors = tf.stack([t(ids[:, f]) for f, t in enumerate(self.tables)], axis=1)
        linear = tf.add_n([t(ids[:, f]) for f, t in enumerate(self.weights_1)])[:, 0] + self.dense_linear(dense)[:, 0]
        fm = 0.5 * tf.reduce_sum(tf.square(tf.reduce_sum(vectors, 1)) - tf.reduce_sum(tf.square(vectors), 1), 1)
        deep = self.dnn(tf.concat([tf.reshape(vectors, [-1, SPARSE * vectors.shape[-1]]), dense], 1))[:, 0]
        return linear + fm + deep


BOUNDARIES = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0]  # deeprec/models/wdl.py's DENSE_BOUNDARIES


class WDL(tf.keras.Model):
    """deeprec/models/wdl.py: wide (per-id and per-dense-bucket weights) + DNN 1024-512-256."""

    def __init__(self, buckets: int, dim: int = 16):
        super().__init__()
        self.tables, self.wide_ids = _tables(buckets, dim), _tables(buckets, 1)
        self.wide_dense = tf.keras.layers.Embedding(DENSE * (len(BOUNDARIES) + 1), 1, embeddings_initializer="zeros")
        self.offsets = tf.range(DENSE) * (len(BOUNDARIES) + 1)
        self.dnn = _mlp((1024, 512, 256))

    def call(self, inputs):
        dense, ids = inputs
        vectors = tf.concat([t(ids[:, f]) for f, t in enumerate(self.tables)], axis=1)
        buckets = tf.raw_ops.Bucketize(input=dense, boundaries=BOUNDARIES) + self.offsets
        wide = (tf.add_n([t(ids[:, f]) for f, t in enumerate(self.wide_ids)])[:, 0]
                + tf.reduce_sum(self.wide_dense(buckets), axis=(1, 2)))
        return wide + self.dnn(tf.concat([vectors, dense], 1))[:, 0]


MODELS = {"dlrm": DLRM, "deepfm": DeepFM, "wdl": WDL}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--buckets", type=int, default=10000)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--jit", action="store_true")
    p.add_argument("--model", choices=sorted(MODELS), default="dlrm")
    args = p.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    model = MODELS[args.model](args.buckets)
    opt = tf.keras.optimizers.Adagrad(0.01)
    loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)

    @tf.function(jit_compile=args.jit)
    def step(features, label):
        with tf.GradientTape() as tape:
            loss = loss_fn(label, model(features))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    it = iter(dataset(args.data, args.batch_size, args.buckets))
    for _ in range(args.warmup):
        step(*next(it))
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step(*next(it))
    float(loss)
    elapsed = time.perf_counter() - start
    print(json.dumps({"tensorflow": tf.__version__, "model": args.model, "jit_compile": args.jit, "steps": args.steps,
                      "samples_per_s": args.steps * args.batch_size / elapsed, "final_loss": float(loss)}))


if __name__ == "__main__":
    main()
