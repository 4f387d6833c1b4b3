"""Mixed precision in a custom training loop, on every strategy (runs on a CPU in seconds).

    python examples/custom_loop.py --precision mixed_float16
    tfdist run -n 2 -- python examples/custom_loop.py --precision mixed_bfloat16

The recipe (Micikevicius et al. 2018): float32 master weights, half-precision compute,
the loss multiplied by a dynamic scale, the gradients divided by it, steps whose
gradients overflow on ANY replica skipped (the scale halves), and the scale doubled
after ``dynamic_growth_steps`` finite steps. ``tfdist.precision.make_train_step`` does
it in one ``strategy.run`` step; ``--manual`` runs the same step spelled out (``manual_step``).
"""

import argparse

import numpy as np

import tfdist

parser = argparse.ArgumentParser()
parser.add_argument("--precision", default="mixed_float16",
                    choices=["float32", "mixed_float16", "mixed_bfloat16", "auto"])
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--manual", action="store_true", help="run manual_step instead of make_train_step")
args = parser.parse_args()

with tfdist.scope(precision=args.precision) as strategy:  # the strategy first, then any TF op
    import keras
    import tensorflow as tf

    from tfdist import precision

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
        keras.layers.Activation("softmax", dtype="float32"),  # softmax and loss in float32
    ])
    # float16: a LossScaleOptimizer. bfloat16 has float32's range and needs no scaling;
    # loss_scale=True still buys skip-on-overflow there.
    optimizer = precision.wrap_optimizer(keras.optimizers.Adam(1e-3), loss_scale=True)
    optimizer.build(model.trainable_variables)  # before tracing: tf.function cannot create variables
precision.check_model(model)
loss_fn = keras.losses.SparseCategoricalCrossentropy()


def manual_step(x, y):
    """What make_train_step runs on each replica."""
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
        scaled = optimizer.scale_loss(loss / strategy.num_replicas_in_sync)  # times the loss scale
    grads = tape.gradient(scaled, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)  # unscales; skips if any replica overflowed
    return loss


def dataset_fn(context):
    rng = np.random.default_rng(context.input_pipeline_id)
    x = rng.normal(size=(4096, 16)).astype("float32")
    y = np.argmax(x[:, :10], axis=1)
    batch = context.get_per_replica_batch_size(64)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch)


@tf.function
def distributed_manual_step(batch):
    return strategy.reduce("MEAN", strategy.run(manual_step, args=batch), axis=None)


step = distributed_manual_step if args.manual else precision.make_train_step(model, loss_fn, optimizer, strategy)
batches = iter(strategy.distribute_datasets_from_function(dataset_fn))
for i in range(args.steps):
    loss = float(step(next(batches)))
    if i % 20 == 0 or i == args.steps - 1:
        print(f"step {i:3d}  loss {loss:.4f}  loss scale {precision.current_loss_scale(optimizer)}")
print(f"{args.precision}: compute {model.layers[0].compute_dtype}, variables {model.layers[0].kernel.dtype}, "
      f"{strategy.num_replicas_in_sync} replica(s)")
