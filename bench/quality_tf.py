"""TensorFlow peer of bench/quality.py: bench/tf_dlrm.py's Keras DLRM trained on the arrays that
deeprec's feature layer encoded (the same hashed ids, dense values, batches and order), its eval
logits written for deeprec.metrics to score. Runs in .venv-tf (no torch there):

    .venv-tf/bin/python bench/quality_tf.py --arrays DIR --steps N --eval-every K --out FILE.npz

Initialisation as deeprec's: embeddings U(-0.05, 0.05) (tf_dlrm's own), Dense kernels and biases
U(+-1/sqrt(fan_in)) (torch's nn.Linear default, set after building). Adagrad with initial
accumulator 0.1 and epsilon 1e-10 (Keras 3 adds it inside the square root: sqrt(acc + eps); torch
and deeprec outside: sqrt(acc) + eps; with acc >= 0.1 the difference is below 1e-9 relative).
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tf_dlrm import DLRM, tf  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arrays", required=True, help="folder with train_*.npy and eval_*.npy")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--eval-every", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--optimizer", default="adagrad")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--buckets", type=int, default=10000)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--out", required=True)
    args = p.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.keras.utils.set_random_seed(0)
    load = lambda name: np.load(os.path.join(args.arrays, name))  # noqa: E731
    dense, ids, label = load("train_dense.npy"), load("train_ids.npy"), load("train_label.npy")
    eval_dense, eval_ids = load("eval_dense.npy"), load("eval_ids.npy")

    model = DLRM(args.buckets)
    model((dense[:2], ids[:2]))  # build
    for layer in model.bottom.layers + model.top.layers:
        bound = 1.0 / np.sqrt(layer.kernel.shape[0])
        layer.kernel.assign(tf.random.uniform(layer.kernel.shape, -bound, bound))
        layer.bias.assign(tf.random.uniform(layer.bias.shape, -bound, bound))
    if args.optimizer == "adagrad":
        opt = tf.keras.optimizers.Adagrad(args.lr, initial_accumulator_value=0.1, epsilon=1e-10)
    else:
        opt = tf.keras.optimizers.Adam(args.lr, epsilon=1e-8)
    loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True)

    @tf.function
    def step(d, i, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model((d, i)))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    predict = tf.function(lambda d, i: model((d, i)))

    def eval_logits():
        return np.concatenate([predict(eval_dense[s:s + 4096], eval_ids[s:s + 4096]).numpy()
                               for s in range(0, len(eval_dense), 4096)])

    starts = list(range(0, len(label), args.batch_size))
    steps, logits, losses = [], [], []
    start = time.perf_counter()
    for k in range(args.steps):
        s = starts[k % len(starts)]
        sl = slice(s, min(s + args.batch_size, len(label)))
        losses.append(float(step(dense[sl], ids[sl], label[sl])))
        if (k + 1) % args.eval_every == 0 or k + 1 == args.steps:
            steps.append(k + 1)
            logits.append(eval_logits())
    np.savez(args.out, steps=np.array(steps), logits=np.stack(logits))
    print(json.dumps({"tensorflow": tf.__version__, "keras": tf.keras.__version__, "final_loss": losses[-1],
                      "seconds": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
