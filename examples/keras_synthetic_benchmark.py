"""Synthetic training throughput of a Keras model on N ranks with spark_dl.

Random images and labels, no input pipeline: what is measured is the training step plus the
gradient allreduce. Run it under sdlrun (one process per rank)::

    .venv/bin/sdlrun -np 2 .venv/bin/python examples/keras_synthetic_benchmark.py
    .venv/bin/sdlrun -np 2 .venv/bin/python examples/keras_synthetic_benchmark.py \\
        --api tape --fp16-allreduce --num-iters 5
    .venv/bin/sdlrun -np 2 .venv/bin/python examples/keras_synthetic_benchmark.py \\
        --model MobileNetV2 --image-size 96 --batch-size 16

``--api fit`` (default) trains with ``model.fit`` and ``spark_dl.keras.DistributedOptimizer``;
``--api tape`` runs a ``tf.function`` step with ``spark_dl.tensorflow.DistributedGradientTape``
(TensorFlow backend only). ``--model`` is ``small_cnn`` or any ``keras.applications`` name.
Rank 0 prints images/s per iteration and the mean over iterations, per rank and in total.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import spark_dl.keras as hvd  # noqa: E402


def small_cnn(image_size=32, classes=10, width=32):
    """Two 3x3 convolutions, a pooling and two dense layers (8 weight tensors)."""
    return keras.Sequential([
        keras.Input((image_size, image_size, 3)),
        keras.layers.Conv2D(width, 3, activation="relu"),
        keras.layers.Conv2D(2 * width, 3, activation="relu"),
        keras.layers.MaxPooling2D(4),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(classes),
    ])


def build_model(name, image_size, classes=10):
    if name == "small_cnn":
        return small_cnn(image_size, classes)
    try:
        app = getattr(keras.applications, name)
    except AttributeError:
        raise SystemExit(f"--model {name}: not small_cnn and not a keras.applications model")
    return app(weights=None, input_shape=(image_size, image_size, 3), classes=classes)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small_cnn")
    p.add_argument("--api", choices=("fit", "tape"), default="fit")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    p.add_argument("--num-warmup-batches", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=5)
    return p.parse_args(argv)


class _IterTimer(keras.callbacks.Callback):
    """Times every group of ``per_iter`` batches after ``warmup`` batches."""

    def __init__(self, warmup, per_iter):
        super().__init__()
        self.warmup, self.per_iter = warmup, per_iter
        self.times, self._start = [], None

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1 - self.warmup
        if done == 0:
            self._start = time.perf_counter()
        elif done > 0 and done % self.per_iter == 0:
            now = time.perf_counter()
            self.times.append(now - self._start)
            self._start = now


def run_fit(args, model, x, y, opt):
    model.compile(optimizer=hvd.DistributedOptimizer(
        opt, compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    timer = _IterTimer(args.num_warmup_batches, args.num_batches_per_iter)
    steps = args.num_warmup_batches + args.num_iters * args.num_batches_per_iter
    model.fit(_repeat(x, y, steps), steps_per_epoch=steps, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer])
    return timer.times


def _repeat(x, y, steps):
    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return steps

        def __getitem__(self, i):
            return x, y
    return Batches()


def run_tape(args, model, x, y, opt):
    import tensorflow as tf

    import spark_dl.tensorflow as hvd_tf
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = hvd_tf.Compression.fp16 if args.fp16_allreduce else hvd_tf.Compression.none
    x, y = tf.constant(x), tf.constant(y)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd_tf.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    opt.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables + opt.variables, root_rank=0)
    for _ in range(args.num_warmup_batches):
        step()
    times = []
    for _ in range(args.num_iters):
        t0 = time.perf_counter()
        for _ in range(args.num_batches_per_iter):
            step()
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    if args.api == "tape" and keras.backend.backend() != "tensorflow":
        raise SystemExit("--api tape needs KERAS_BACKEND=tensorflow")
    keras.utils.set_random_seed(1234)
    model = build_model(args.model, args.image_size)
    rng = np.random.default_rng(hvd.rank())
    x = rng.random((args.batch_size, args.image_size, args.image_size, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=(args.batch_size,)).astype(np.int32)
    opt = keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
    times = (run_fit if args.api == "fit" else run_tape)(args, model, x, y, opt)
    rates = [args.batch_size * args.num_batches_per_iter / t for t in times]
    if hvd.rank() == 0:
        print(f"Model: {args.model}, API: {args.api}, batch size: {args.batch_size}, "
              f"ranks: {hvd.size()}, backend: {keras.backend.backend()}, "
              f"fp16 allreduce: {args.fp16_allreduce}")
        for i, r in enumerate(rates):
            print(f"Iter #{i}: {r:.1f} img/sec per rank")
        mean, conf = float(np.mean(rates)), 1.96 * float(np.std(rates))
        print(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
        print(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} "
              f"+-{hvd.size() * conf:.1f}")


if __name__ == "__main__":
    main()
