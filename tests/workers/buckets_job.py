"""2 workers: training with gradient buckets (every gradient its own all-reduce) against one pack.

argv: OUT_DIR [mismatch]. First issue 28's cases (below), then autotune (``tfdist.autotune``): off by TFDIST_AUTOTUNE=0 (the
suite's), then on until it settles, against one pack; off under an explicit bucket size; a later run's reuse of the
chief's record. Then each case trains the same model from the same weights twice, with
``tfdist.set_bucket_bytes(1)`` and with 0, and writes both results, how many all-reduce calls
the optimizer made, and (custom loop) whether the first bucket's collective waits for the first
layer's gradient. With ``mismatch``, worker 1 alone uses buckets: its fit must fail.
Issue 28's cases run first, with the default buckets, each beside its one-device weights
(``EXACTNESS``, under the key "exactness"): a MultiOptimizer under mixed_float16, a float64 layer, an Embedding with a
partial last batch, Keras' accumulation with use_ema's overwrite.
"""

import contextlib
import hashlib
import os
import sys

import keras
import numpy as np
import tensorflow as tf

rank = int(os.environ["TFDIST_WORKER_INDEX"])
os.sched_setaffinity(0, {rank % os.cpu_count()})  # a one-core worker, before the strategy is built

import tfdist  # noqa: E402
from tfdist import devices, process_group  # noqa: E402
from tests.workers import common  # noqa: E402

out_dir = sys.argv[1]
strategy = tfdist.get_strategy()
GLOBAL, LOCAL = 16, 8
CLIP = 0.01  # small enough to clip every step
rng = np.random.default_rng(3)
x = rng.normal(size=(4 * GLOBAL, 8, 8, 3)).astype("float32")
y = rng.integers(0, 4, size=(4 * GLOBAL,))
calls = {"all_reduce": 0, "batch_reduce_to": 0, "grouped_allreduce": 0}


def counted(owner, name):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)
    setattr(owner, name, wrapper)


counted(tf.distribute.ReplicaContext, "all_reduce")
counted(tf.distribute.StrategyExtended, "batch_reduce_to")
counted(process_group.ProcessGroup, "grouped_allreduce")


def build():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def digest(model) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())).hexdigest()


def first_collective_needs_first_gradient(graph, first_gradient: str) -> bool:
    """Whether the first all-reduce created in ``graph`` depends on the op named ``first_gradient``."""
    collective = next(op for op in graph.get_operations() if op.type == "CollectiveReduceV2")
    seen, stack = set(), [collective]
    while stack:
        op = stack.pop()
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                stack.append(parent)
    return first_gradient in seen


def fit_case(make_optimizer):
    with strategy.scope():
        model = build()
        model.compile(make_optimizer(), loss_fn())
    history = model.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    return model, history.history["loss"]


def tape_case(make_optimizer):
    with strategy.scope():
        model = build()
        optimizer = make_optimizer()
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    first_gradient = []

    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(per_example(labels, model(images, training=True)),
                                              global_batch_size=GLOBAL)
            scaled = optimizer.scale_loss(loss)  # a LossScaleOptimizer's scale; 1 otherwise
        gradients = tape.gradient(scaled, model.trainable_variables)
        first_gradient.append(gradients[0].op.name)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    train_step = tf.function(lambda images, labels: strategy.run(step, args=(images, labels)))
    losses = []
    for start in range(0, len(x), GLOBAL):
        shard = slice(start + rank * LOCAL, start + (rank + 1) * LOCAL)
        losses.append(float(train_step(x[shard], y[shard])))
    graph = train_step.get_concrete_function(x[:LOCAL], y[:LOCAL]).graph
    return model, losses, first_collective_needs_first_gradient(graph, first_gradient[0])


def local_half(array):
    """This worker's half of every global batch, in order."""
    return np.concatenate([array[s + rank * LOCAL:s + (rank + 1) * LOCAL] for s in range(0, len(array), GLOBAL)])


def horovod_case(kind):
    import tfdist.horovod as hvd

    hvd.init()
    model = build()  # no strategy: each process its own model, gradients averaged across processes
    images, labels = local_half(x), local_half(y)
    if kind == "optimizer":
        model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss_fn())
        return model, model.fit(images, labels, batch_size=LOCAL, epochs=2, shuffle=False, verbose=0).history["loss"]
    optimizer = keras.optimizers.SGD(0.05)

    @tf.function
    def train_step(batch_images, batch_labels):
        with tf.GradientTape() as tape:
            loss = loss_fn()(batch_labels, model(batch_images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    losses = [float(train_step(images[i:i + LOCAL], labels[i:i + LOCAL])) for i in range(0, len(images), LOCAL)]
    return model, losses


def autotune_cases() -> dict:
    """Two fits that train (autotune on, one pack) and, for the switches, whether Keras' train function would tune."""
    from tfdist import autotune, buckets

    def compiled():
        with strategy.scope():
            model = build()
            model.compile(keras.optimizers.SGD(0.05, momentum=0.9), loss_fn())
        return model

    def tunes() -> bool:
        """Whether fit would tune: the train function it makes is a tuner (made, not traced: no step runs)."""
        model = compiled()
        model.make_train_function()
        return isinstance(model.train_function, autotune.Tuner)

    def fit(epochs):
        model = compiled()
        traces = []  # the step runs in Python only while a train function is traced
        train_step = model.train_step
        model.train_step = lambda data: traces.append(1) or train_step(data)
        history = model.fit(np.tile(x, (5, 1, 1, 1)), np.tile(y, 5), batch_size=GLOBAL, epochs=epochs, shuffle=False,
                            verbose=0)
        return {"digest": digest(model), "losses": history.history["loss"], "traces": len(traces),
                "tuning": isinstance(model.train_function, autotune.Tuner)}

    os.environ[autotune.ENV_FILE] = os.path.join(out_dir, "autotune.json")
    result = {"env_off_tunes": tunes()}  # TFDIST_AUTOTUNE=0 from the test
    autotune.set_autotune(True)
    result["on_tunes"] = tunes()
    result["on"] = fit(EPOCHS_TO_SETTLE)
    choice = autotune.last_choice()
    result["choice"] = {"setting": str(choice.setting), "steps": choice.steps, "rounds": list(choice.step_ms),
                        "bucket_sizes": list(buckets.bucket_sizes())}
    autotune._chosen.clear()  # as a later run would start: the chief's record decides, no tuning
    result["reused_tunes"] = tunes()
    reused = autotune.last_choice()
    result["reused_choice"] = {"setting": str(reused.setting), "steps": reused.steps} if reused else None
    tfdist.set_bucket_bytes(0)
    result["one_pack"] = fit(EPOCHS_TO_SETTLE)
    tfdist.set_bucket_bytes(1)  # explicit: never tuned
    autotune._chosen.clear()
    result["explicit_tunes"] = tunes()
    result["explicit_bucket_sizes"] = list(buckets.bucket_sizes())
    return result


# 20 steps an epoch (calls of 16 and 4): 2 candidates x 2 rounds x 16 timed steps, and an untimed first call each
EPOCHS_TO_SETTLE = 6

CASES = {
    "fit": lambda: fit_case(lambda: keras.optimizers.SGD(0.05, momentum=0.9)),
    "tape": lambda: tape_case(lambda: keras.optimizers.Adam(0.01)),
    "loss_scale_fit": lambda: fit_case(lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9))),
    "loss_scale_tape": lambda: tape_case(lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))),
    "clip_fit": lambda: fit_case(lambda: keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=CLIP)),
    "clip_tape": lambda: tape_case(lambda: keras.optimizers.Adam(0.01, global_clipnorm=CLIP)),
    "accumulation": lambda: fit_case(lambda: tfdist.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), backward_passes_per_step=2)),
    "fp16": lambda: fit_case(lambda: tfdist.DistributedOptimizer(
        keras.optimizers.SGD(0.05), compression=tfdist.Compression.fp16)),
    "hvd_optimizer": lambda: horovod_case("optimizer"),
    "hvd_tape": lambda: horovod_case("tape"),
}


def exactness_mlp(dtype=None):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="enc")(inputs)
    if dtype:
        hidden = keras.layers.Dense(4, dtype=dtype, name="wide")(hidden)
    return keras.Model(inputs, keras.layers.Dense(1, name="head", dtype="float32")(hidden))


def exactness_embedding():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(20, 3),
                             keras.layers.Flatten(), keras.layers.Dense(1)])


def multi_optimizer():
    optimizers = keras.optimizers.OptimizerMap(keras.optimizers.SGD(0.05, momentum=0.9))
    optimizers["enc/.*"] = keras.optimizers.SGD(0.02, clipnorm=1.0)
    return keras.optimizers.MultiOptimizer(optimizers)


features = rng.normal(size=(48, 6)).astype("float32")
ids = rng.integers(0, 20, size=(46, 4)).astype("int32")  # 46 at batch 16: a partial last batch
EXACTNESS = {  # name: (policy, model, optimizer, inputs, targets)
    "multi_optimizer_mixed_float16": ("mixed_float16", exactness_mlp, multi_optimizer, features, features[:, :1]),
    "float64_layer": ("float32", lambda: exactness_mlp("float64"), lambda: keras.optimizers.SGD(0.05, momentum=0.9),
                      features, features[:, :1]),
    "embedding_partial_batch": ("float32", exactness_embedding, lambda: keras.optimizers.SGD(0.05, momentum=0.9),
                                ids, ids[:, :1].astype("float32") / 20),
    "accumulation_ema": ("float32", exactness_mlp, lambda: keras.optimizers.AdamW(
        0.01, gradient_accumulation_steps=2, use_ema=True, ema_overwrite_frequency=2, global_clipnorm=0.1),
        features, features[:, :1]),
}


def exactness_case(policy, build, make_optimizer, inputs, targets, distributed):
    keras.config.set_dtype_policy(policy)
    with strategy.scope() if distributed else contextlib.nullcontext():
        model = build()
        model.compile(make_optimizer(), "mse")
    model.fit(inputs, targets, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    keras.config.set_dtype_policy("float32")
    return {"weights": [w.tolist() for w in model.get_weights()], "digest": digest(model),
            "iterations": int(model.optimizer.iterations.numpy())}


if sys.argv[2:] == ["mismatch"]:
    tfdist.set_bucket_bytes(1 if rank == 1 else 0)
    try:
        fit_case(lambda: keras.optimizers.SGD(0.05))
        common.write_result(out_dir, {"error": None})
    except Exception as error:  # noqa: BLE001  (the test reads the message)
        common.write_result(out_dir, {"error": f"{type(error).__name__}: {error}"})
        raise
    sys.exit(0)

one_device = build()  # no strategy: the clipped reference a 2-worker run must equal
one_device.compile(keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=CLIP), loss_fn())
one_device.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
payload = {"inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
           "clip_one_device": [w.tolist() for w in one_device.get_weights()],
           "exactness": {name: {"two_workers": exactness_case(*case, distributed=True),  # default buckets: first
                                "one_device": exactness_case(*case, distributed=False)}
                         for name, case in EXACTNESS.items()},
           "autotune": autotune_cases()}  # after: it leaves an explicit bucket size set
for name, case in CASES.items():
    for bucket_bytes in (1, 0):
        tfdist.set_bucket_bytes(bucket_bytes)
        before = dict(calls)
        model, losses, *needs = case()
        payload[f"{name}/{bucket_bytes}"] = {
            "digest": digest(model), "losses": losses, "needs_first_gradient": needs[0] if needs else None,
            "calls": {k: calls[k] - before[k] for k in calls},
            "variables": len(model.trainable_variables),
            "weights": [w.tolist() for w in model.get_weights()] if name == "clip_fit" else None}


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


tfdist.set_bucket_bytes(1)  # 6 all-reduces a step
with strategy.scope():
    model = build()
    model.compile(keras.optimizers.SGD(0.05), loss_fn())
model.fit(x, y, batch_size=GLOBAL, epochs=1, verbose=0)
before = threads()
model.fit(np.tile(x, (10, 1, 1, 1)), np.tile(y, 10), batch_size=GLOBAL, epochs=1, verbose=0)  # 40 steps
payload.update(threads_added_by_40_steps=threads() - before,
               cpu_allocator=os.environ.get(devices.CPU_ALLOCATOR_ENV))
common.write_result(out_dir, payload)
