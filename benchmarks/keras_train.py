"""Keras training throughput on 2 ranks: spark_dl.keras.DistributedOptimizer against
TensorFlow's own MultiWorkerMirroredStrategy, and the per-step overhead of spark_dl's
allreduce op inside tf.function.

    PYTHONPATH=. .venv/bin/python benchmarks/keras_train.py                  # 3 jobs
    PYTHONPATH=. .venv/bin/python benchmarks/keras_train.py --quick
    PYTHONPATH=. .venv/bin/python benchmarks/keras_train.py --overhead-only
    PYTHONPATH=. .venv/bin/python benchmarks/keras_train.py --separate-jobs --steps 80
    PYTHONPATH=. .venv/bin/python benchmarks/keras_train.py --load 2 --overhead-steps 0

Throughput. One ``sdlrun -np 2`` job per round holds every peer: each rank initializes
spark_dl, then (before any TensorFlow op, as the strategy requires) a
``tf.distribute.MultiWorkerMirroredStrategy`` whose ``TF_CONFIG`` names both ranks on
127.0.0.1, and builds one replica of examples/keras_synthetic_benchmark.py's small CNN
(SGD with momentum, the same initial weights) per peer:

================  ======================================================================
spark_dl          a ``tf.function`` step with ``DistributedGradientTape``
mwms              ``MultiWorkerMirroredStrategy`` with RING collectives (what
                  spark-tensorflow-distributor uses): TensorFlow's ``strategy.run``
                  custom-loop recipe, because Keras 3's ``model.fit`` does not run under
                  this strategy (keras-team/keras issue 20585)
spark_dl_fit      the train function ``model.fit`` compiles, with
                  ``DistributedOptimizer(SGD)``, called step by step
local             the ``tf.function`` step with no communication (the ceiling under the
                  same CPU contention)
local_fit         ``model.fit``'s train function with the plain optimizer: no
                  communication, the ceiling of ``spark_dl_fit`` (issue 34's target:
                  ``spark_dl_fit`` >= 93% of it)
================  ======================================================================

Timed stretches of ``--steps`` steps alternate between the peers (``--iters`` per peer,
the order rotating every stretch), so the noise of a shared machine hits every peer alike;
whole jobs per peer (``--separate-jobs``) moved by a factor of 3 between rounds on a loaded
2-core machine. XLA is off everywhere, and every peer runs with ``--threads`` TensorFlow
intra- and inter-op threads (default 1: two ranks on two cores); each keeps its own
communication threads (spark_dl's background thread, the strategy's gRPC and collective
threads). The table gives images/s per rank (rank 0's clock): the median over all
stretches of all jobs, the 10th-90th percentile, rank 0's CPU time per step (all threads
of the process), and spark_dl's speed relative to each peer three ways: the ratio of the
pooled medians, the ratio of each job's medians, and the median (and quartiles) of the
ratios of stretches timed back to back in the same rotation.

Overhead (``--overhead-steps``): inside one ``sdlrun`` job of 1 and of 2 ranks, a
``tf.function`` step computing the gradients of a model with ``--tensors`` weight tensors
and applying them with SGD, timed three ways in alternation: without any allreduce, with
spark_dl's grouped allreduce (one ``tf.numpy_function`` op, the path DistributedOptimizer
takes), and with the same grouped allreduce through ``tf.py_function`` + DLPack (the
alternative bridge, measured to justify the choice).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import _harness as H  # noqa: E402  (benchmarks/, this script's folder)

MARK = "SDL_KERAS_BENCH "
PEERS = ("spark_dl", "mwms", "spark_dl_fit", "local", "local_fit")
FIT_TARGET = 0.93  # issue 34: model.fit with spark_dl >= 93% of model.fit without communication
LABELS = {"spark_dl": "spark_dl DistributedGradientTape (tf.function loop)",
          "spark_dl_fit": "spark_dl DistributedOptimizer (model.fit's train function)",
          "local": "no communication (ceiling, tf.function loop)",
          "local_fit": "no communication (ceiling, model.fit's train function)",
          "mwms": "tf.distribute MultiWorkerMirroredStrategy (strategy.run loop)"}


# ----------------------------------------------------------------------------- worker side

def _quiet_tf(threads):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    return tf


def _batch(args):
    import numpy as np
    rng = np.random.default_rng(0)
    x = rng.random((args.batch_size, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, size=(args.batch_size,)).astype(np.int32)
    return x, y


def _timed(step, args):
    """Runs ``step()`` ``--warmup`` times untimed, then ``--steps`` times; img/s per rank."""
    for _ in range(args.warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    return args.batch_size * args.steps / (time.perf_counter() - t0)


def _loss_fn(keras):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def worker_spark_dl(args, peer):
    tf = _quiet_tf(args.threads)
    import keras

    import spark_dl.keras as hvd
    import spark_dl.tensorflow as hvd_tf
    from keras_synthetic_benchmark import small_cnn
    hvd.init()
    keras.utils.set_random_seed(0)
    model = small_cnn()
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    x, y = _batch(args)
    if peer in ("spark_dl_fit", "local_fit"):
        model.compile(optimizer=hvd.DistributedOptimizer(opt) if peer == "spark_dl_fit" else opt,
                      loss=_loss_fn(keras), jit_compile=False)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        it = iter(ds)
        # model.fit's own loop, one step per call: the same timing as the other peers.
        model.fit(ds, steps_per_epoch=1, epochs=1, verbose=0)
        train = model.make_train_function()
        rate = _timed(lambda: train(it), args)
    else:
        loss_fn = _loss_fn(keras)
        x, y = tf.constant(x), tf.constant(y)
        opt.build(model.trainable_variables)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if peer == "spark_dl":
                tape = hvd_tf.DistributedGradientTape(tape)
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        rate = _timed(step, args)
    return hvd.rank(), {"img_per_s": rate, "tensors": len(model.trainable_variables)}


def worker_mwms(args):
    tf = _quiet_tf(args.threads)
    import keras

    from keras_synthetic_benchmark import small_cnn
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = small_cnn()
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        opt.build(model.trainable_variables)
    loss_fn = _loss_fn(keras)
    x, y = (tf.constant(a) for a in _batch(args))

    # Keras 3's model.fit does not run under MultiWorkerMirroredStrategy (keras-team/keras
    # issue 20585), so this peer is TensorFlow's custom-loop recipe: strategy.run over a
    # tf.function step, the optimizer summing the replicas' gradients.
    @tf.function
    def step():
        def replica_step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True)) / strategy.num_replicas_in_sync
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
        strategy.run(replica_step)
    rate = _timed(step, args)
    return json.loads(os.environ["TF_CONFIG"])["task"]["index"], {"img_per_s": rate}


def worker_interleaved(args):
    """Every peer in one job, timed in alternating stretches (``--steps`` steps each)."""
    import spark_dl.keras as hvd
    hvd.init()  # spark_dl's core runs no TensorFlow op: MultiWorkerMirroredStrategy,
    rank, size = hvd.rank(), hvd.size()  # which must come before any, is still possible
    ports = hvd.broadcast_object([H._free_port() for _ in range(size)] if rank == 0 else None, 0)
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": rank}})
    tf = _quiet_tf(args.threads)
    import keras

    import spark_dl.tensorflow as hvd_tf
    from keras_synthetic_benchmark import small_cnn
    from spark_dl.tensorflow.gradient_tape import allreduce_gradients
    comm = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    loss_fn = _loss_fn(keras)
    x, y = (tf.constant(a) for a in _batch(args))

    def build():
        keras.utils.set_random_seed(0)
        model = small_cnn()
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        opt.build(model.trainable_variables)
        return model, opt

    def grads_ready(grads):
        # --sync-timing: the wall clock once this rank's gradients exist (None otherwise).
        if not args.sync_timing:
            return None
        with tf.control_dependencies(grads):
            return tf.timestamp()

    def tape_step(model, opt, distributed):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if distributed and not args.sync_timing:
                tape = hvd_tf.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            t_grads = grads_ready(grads)
            if distributed and args.sync_timing:
                # What DistributedGradientTape.gradient does after the local gradients.
                grads = allreduce_gradients(grads, name="DistributedGradientTape")
            opt.apply(grads, model.trainable_variables)
            return t_grads
        return step

    steps = {}
    with strategy.scope():
        mw_model, mw_opt = build()

    # Keras 3's model.fit does not run under MultiWorkerMirroredStrategy (keras-team/keras
    # issue 20585): TensorFlow's custom-loop recipe, the optimizer summing the replicas'
    # gradients (the loss is divided by the replica count: an average, as spark_dl's).
    @tf.function
    def mwms_step():
        def replica_step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, mw_model(x, training=True)) / strategy.num_replicas_in_sync
            grads = tape.gradient(loss, mw_model.trainable_variables)
            t_grads = grads_ready(grads)
            mw_opt.apply(grads, mw_model.trainable_variables)
            return t_grads
        return strategy.run(replica_step)
    steps["mwms"] = mwms_step
    steps["spark_dl"] = tape_step(*build(), distributed=True)
    steps["local"] = tape_step(*build(), distributed=False)
    ds = tf.data.Dataset.from_tensors((x, y)).repeat()

    def fit_step(distributed):
        # model.fit's own train function, one step per call (what fit's loop calls).
        model, opt = build()
        model.compile(optimizer=hvd.DistributedOptimizer(opt) if distributed else opt,
                      loss=loss_fn, jit_compile=False)
        model.fit(ds, steps_per_epoch=1, epochs=1, verbose=0)
        it, train = iter(ds), model.make_train_function()
        return lambda: train(it)
    steps["spark_dl_fit"] = fit_step(distributed=True)
    steps["local_fit"] = fit_step(distributed=False)

    peers = [p for p in PEERS if p in args.peers.split(",")]
    for p in peers:
        for _ in range(args.warmup):
            steps[p]()
    rates = {p: [] for p in peers}
    cpu_ms = {p: [] for p in peers}  # this process's CPU time per step, all its threads
    stamps = {p: [] for p in peers}  # --sync-timing: (gradients ready, step returned)
    for i in range(args.iters):
        for p in peers[i % len(peers):] + peers[:i % len(peers)]:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                t_grads = steps[p]()
                if args.sync_timing and p not in ("spark_dl_fit", "local_fit"):
                    stamps[p].append((float(t_grads), time.time()))
            rates[p].append(args.batch_size * args.steps / (time.perf_counter() - t0))
            cpu_ms[p].append((time.process_time() - c0) * 1e3 / args.steps)
    res = {"rates": rates, "cpu_ms": cpu_ms}
    if args.sync_timing:
        # How long after the LAST rank's gradients existed this rank's step returned: the
        # exchange, the update and the way back, without the wait for a slower rank.
        every = hvd.allgather_object(stamps)
        res["sync_ms"] = {p: [(mine[1] - max(s[p][n][0] for s in every)) * 1e3
                              for n, mine in enumerate(stamps[p])] for p in peers}
    return rank, res


def _overhead_model(keras, tensors):
    """A stack of Dense layers with ``tensors`` weight tensors (kernels and biases)."""
    layers = [keras.Input((64,))]
    for _ in range(tensors // 2):
        layers.append(keras.layers.Dense(64, activation="tanh"))
    return keras.Sequential(layers)


def worker_overhead(args):
    tf = _quiet_tf(args.threads)
    import keras
    import numpy as np

    import spark_dl.tensorflow as hvd
    from spark_dl.common import ops as _ops
    hvd.init()
    model = _overhead_model(keras, args.tensors)
    opt = keras.optimizers.SGD(0.001)
    opt.build(model.trainable_variables)
    x = tf.constant(np.random.default_rng(hvd.rank()).random((32, 64), dtype=np.float32))
    variables = model.trainable_variables

    def dlpack_grouped_allreduce(grads):
        # The alternative bridge, packed the same way (one flat tensor): an EagerTensor in,
        # DLPack capsules to the core and back, the output allocated by TensorFlow.
        flat = tf.concat([tf.reshape(g, [-1]) for g in grads], 0)

        def body(t):
            out = tf.zeros_like(t)
            h = _ops.submit("allreduce", "dlpack_bench", tf.experimental.dlpack.to_dlpack(t),
                            tf.experimental.dlpack.to_dlpack(out), op=hvd.Average)
            h.wait()
            return out
        reduced = tf.py_function(body, [flat], tf.float32)
        sizes = [int(np.prod(g.shape)) for g in grads]
        return [tf.reshape(p, g.shape) for p, g in zip(tf.split(reduced, sizes), grads)]

    def make(kind):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            grads = tape.gradient(loss, variables)
            if kind == "numpy_function":
                grads = hvd.grouped_allreduce(grads, op=hvd.Average, name="overhead")
            elif kind == "py_function_dlpack":
                grads = dlpack_grouped_allreduce(grads)
            opt.apply(grads, variables)
        return step

    kinds = ["none", "numpy_function", "py_function_dlpack"]
    steps = {k: make(k) for k in kinds}
    for k in kinds:
        for _ in range(5):
            steps[k]()
    samples = {k: [] for k in kinds}
    for i in range(args.overhead_steps):
        for k in kinds[i % 3:] + kinds[:i % 3]:
            t0 = time.perf_counter()
            steps[k]()
            samples[k].append(time.perf_counter() - t0)
    return hvd.rank(), {"size": hvd.size(), "tensors": len(variables),
                        "ms": {k: statistics.median(v) * 1e3 for k, v in samples.items()},
                        "p90_ms": {k: sorted(v)[int(0.9 * len(v))] * 1e3
                                   for k, v in samples.items()}}


def worker_main(args):
    if args.worker == "overhead":
        rank, res = worker_overhead(args)
    elif args.worker == "interleaved":
        rank, res = worker_interleaved(args)
    elif args.worker == "mwms":
        rank, res = worker_mwms(args)
    else:
        rank, res = worker_spark_dl(args, args.worker)
    if rank == 0:
        H.print_result(res, MARK)


# ----------------------------------------------------------------------------- driver side

def _worker_args(args, peer):
    return [sys.executable, os.path.abspath(__file__), "--worker", peer,
            "--batch-size", str(args.batch_size), "--warmup", str(args.warmup),
            "--steps", str(args.steps), "--threads", str(args.threads),
            "--tensors", str(args.tensors), "--overhead-steps", str(args.overhead_steps),
            "--iters", str(args.iters), "--peers", args.peers] \
        + (["--sync-timing"] if args.sync_timing else [])


def _result(procs):
    if all(q.returncode == 0 for q in procs):
        for p in procs:
            result = H.parse_result(p.stdout, MARK)
            if result is not None:
                return result
    tail = "\n".join((p.stdout + p.stderr)[-3000:] for p in procs)
    raise RuntimeError(f"job failed (exit codes {[p.returncode for p in procs]}):\n{tail}")


def _run_sdlrun(args, peer, np_):
    env = H._base_env()
    cmd = [sys.executable, "-m", "spark_dl.runner", "-np", str(np_)] + _worker_args(args, peer)
    return _result([subprocess.run(cmd, env=env, capture_output=True, text=True,
                                   timeout=args.timeout)])


def _run_processes(args, peer, np_):
    env = H._base_env()
    procs = []
    ports = [H._free_port() for _ in range(np_)]
    for r in range(np_):
        e = dict(env)
        if peer == "mwms":
            e["TF_CONFIG"] = json.dumps({
                "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                "task": {"type": "worker", "index": r}})
        else:  # local: every process is a 1-rank spark_dl job of its own
            e.update(SDL_RANK="0", SDL_SIZE="1")
        procs.append(subprocess.Popen(_worker_args(args, peer), env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    done, deadline = [], time.monotonic() + args.timeout
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if peer in ("local", "local_fit"):  # every process prints (each is rank 0): keep one
        done = done[:1] + [subprocess.CompletedProcess(p.args, 0, "", "") for p in done[1:]]
    return _result(done)


def _run_peer(args, peer):
    if peer in ("spark_dl", "spark_dl_fit"):
        return _run_sdlrun(args, peer, args.np)
    return _run_processes(args, peer, args.np)


def _quantile(values, q):
    v = sorted(values)
    return v[int(q * (len(v) - 1))]


def _interleaved_report(args, peers):
    """Runs ``--rounds`` interleaved jobs; prints pooled medians, CPU per step, and
    spark_dl's speed against each peer: per job (ratio of the job's medians) and per pair
    of stretches timed back to back (the same rotation of the same job, so the load of the
    moment hits both)."""
    samples = {p: [] for p in peers}
    cpu = {p: [] for p in peers}
    sync = {p: [] for p in peers}
    pairs = {p: [] for p in peers}
    per_job = {p: [] for p in peers}
    fit_jobs, fit_pairs = [], []  # spark_dl_fit / local_fit, per job and per stretch pair
    for r in range(args.rounds):
        t0 = time.perf_counter()
        res = _run_sdlrun(args, "interleaved", args.np)
        rates = res["rates"]
        for p, v in rates.items():
            samples[p] += v
            cpu[p] += res["cpu_ms"][p]
            sync[p] += res.get("sync_ms", {}).get(p, [])
            if "spark_dl" in rates:
                pairs[p] += [a / b for a, b in zip(rates["spark_dl"], v)]
                per_job[p].append(statistics.median(rates["spark_dl"]) / statistics.median(v))
        if "spark_dl_fit" in rates and "local_fit" in rates:
            fit, ceiling = rates["spark_dl_fit"], rates["local_fit"]
            fit_jobs.append(statistics.median(fit) / statistics.median(ceiling))
            fit_pairs += [a / b for a, b in zip(fit, ceiling)]
        print(f"  job {r + 1}/{args.rounds} done ({time.perf_counter() - t0:.0f} s, load "
              f"{os.getloadavg()[0]:.1f}); spark_dl / peer: "
              + ", ".join(f"{p} {per_job[p][-1]:.3f}" for p in peers if per_job[p]),
              file=sys.stderr, flush=True)
    print(f"## Throughput: small CNN, batch {args.batch_size} per rank, one job per round "
          f"with every peer, {args.iters} alternating stretches of {args.steps} steps per "
          f"peer, {args.rounds} job(s)\n")
    print("| peer | img/s per rank (median) | p10-p90 | CPU ms per step (rank 0) | "
          "spark_dl / peer: medians | per job | stretch pairs, median (p25-p75) |")
    print("|---|---|---|---|---|---|---|")
    ref = statistics.median(samples["spark_dl"]) if "spark_dl" in samples else None
    for peer in peers:
        v = samples[peer]
        med = statistics.median(v)
        ratio = f"{ref / med:.3f}" if ref else "-"
        jobs = " ".join(f"{x:.3f}" for x in per_job[peer]) or "-"
        pr = (f"{statistics.median(pairs[peer]):.3f} ({_quantile(pairs[peer], 0.25):.3f}-"
              f"{_quantile(pairs[peer], 0.75):.3f})") if pairs[peer] else "-"
        print(f"| {LABELS[peer]} | {med:.1f} | {_quantile(v, 0.1):.1f}-{_quantile(v, 0.9):.1f} "
              f"| {statistics.median(cpu[peer]):.1f} | {ratio} | {jobs} | {pr} |")
    print()
    if fit_jobs:
        share = statistics.median(samples["spark_dl_fit"]) / statistics.median(
            samples["local_fit"])
        print(f"model.fit with spark_dl against model.fit without communication: {share:.3f} "
              f"of the ceiling (pooled medians; target >= {FIT_TARGET}: "
              f"{'met' if share >= FIT_TARGET else 'NOT met'}); per job "
              + " ".join(f"{x:.3f}" for x in fit_jobs)
              + f"; stretch pairs {statistics.median(fit_pairs):.3f} "
              f"({_quantile(fit_pairs, 0.25):.3f}-{_quantile(fit_pairs, 0.75):.3f})\n")
    timed = [p for p in peers if sync[p] and p != "local"]
    if timed:
        print("From the last rank's gradients to the step's return on rank 0 (exchange, "
              "update, return; ms):\n")
        print("| peer | median | p25-p75 | p90 |")
        print("|---|---|---|---|")
        for peer in timed:
            v = sync[peer]
            print(f"| {LABELS[peer]} | {statistics.median(v):.2f} | {_quantile(v, 0.25):.2f}-"
                  f"{_quantile(v, 0.75):.2f} | {_quantile(v, 0.9):.2f} |")
        print()


def _stats(values):
    return statistics.median(values), min(values), max(values)


def driver(args):
    machine = H.describe_machine()
    print(f"# Keras on {args.np} ranks: {machine}; spark_dl {H.git_revision()}\n")
    peers = [p for p in args.peers.split(",") if p]
    if args.load:
        print(f"{args.load} busy-loop processes run during the throughput jobs\n")
    if not args.overhead_only:
        with H.busy_load(args.load):
            if args.separate_jobs:
                _separate_jobs_report(args, peers)
            else:
                _interleaved_report(args, peers)
    if args.overhead_steps > 0:
        _overhead_report(args)


def _separate_jobs_report(args, peers):
    results = {p: [] for p in peers}
    for r in range(args.rounds):
        for peer in peers[r % len(peers):] + peers[:r % len(peers)]:
            t0 = time.perf_counter()
            results[peer].append(_run_peer(args, peer)["img_per_s"])
            print(f"  round {r + 1}/{args.rounds}: {peer} {results[peer][-1]:.1f} img/s "
                  f"per rank ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(f"## Throughput: small CNN, batch {args.batch_size} per rank, {args.steps} timed "
          f"steps, {args.rounds} round(s)\n")
    print("| peer | img/s per rank (median) | min-max | spark_dl / peer |")
    print("|---|---|---|---|")
    ref = statistics.median(results["spark_dl"]) if "spark_dl" in results else None
    for peer in peers:
        med, lo, hi = _stats(results[peer])
        ratio = f"{ref / med:.2f}" if ref else "-"
        print(f"| {LABELS[peer]} | {med:.1f} | {lo:.1f}-{hi:.1f} | {ratio} |")
    print()


def _overhead_report(args):
    print(f"## Per-step overhead of the allreduce inside tf.function ({args.tensors} "
          f"weight tensors of a Dense stack, batch 32, median of {args.overhead_steps} "
          f"steps each)\n")
    print("| ranks | step without allreduce (ms) | + numpy_function bridge (ms) | "
          "+ py_function/DLPack bridge (ms) |")
    print("|---|---|---|---|")
    for np_ in (1, args.np):
        res = _run_sdlrun(args, "overhead", np_)
        ms = res["ms"]
        base = ms["none"]
        print(f"| {np_} | {base:.2f} | {ms['numpy_function']:.2f} "
              f"(+{ms['numpy_function'] - base:.2f}) | {ms['py_function_dlpack']:.2f} "
              f"(+{ms['py_function_dlpack'] - base:.2f}) |")
    print()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=PEERS + ("overhead", "interleaved"),
                   help=argparse.SUPPRESS)
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=10,
                   help="steps per timed stretch (default 10)")
    p.add_argument("--iters", type=int, default=30,
                   help="timed stretches per peer in the interleaved job (default 30)")
    p.add_argument("--sync-timing", action="store_true",
                   help="also time each step from the last rank's gradients to its return "
                        "(a tf.timestamp op in the steps)")
    p.add_argument("--separate-jobs", action="store_true",
                   help="one job per peer and round instead of one interleaved job")
    p.add_argument("--threads", type=int, default=1,
                   help="TensorFlow intra/inter-op threads per process (default 1)")
    p.add_argument("--tensors", type=int, default=50, help="weight tensors (overhead model)")
    p.add_argument("--overhead-steps", type=int, default=200,
                   help="timed steps per variant for the overhead table (0: skip it)")
    p.add_argument("--overhead-only", action="store_true", help="only the overhead table")
    p.add_argument("--load", type=int, default=0, metavar="N",
                   help="N busy-loop processes run during the throughput jobs (a loaded "
                        "host; default 0)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="1 round, fewer steps")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.iters, args.overhead_steps = 1, 8, 60
    if args.worker:
        worker_main(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
