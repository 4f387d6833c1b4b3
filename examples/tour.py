"""The README's short tour, as a script: tfdist run -n 2 -- python examples/tour.py [OUT_DIR]"""
import os
import sys
import tempfile

import keras
import numpy as np

import tfdist

out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
with tfdist.scope():  # multi_worker under tfdist run, mirrored on several GPUs, else no distribution
    model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    model.compile(optimizer=tfdist.DistributedOptimizer(keras.optimizers.Adam(tfdist.scale_lr(1e-3))),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
rng = np.random.default_rng(0)  # every worker the same arrays: Keras gives each its share of a batch
images, labels = rng.random((2048, 28, 28, 1), "float32"), rng.integers(0, 10, 2048)
model.fit(images, labels, batch_size=128, epochs=2, steps_per_epoch=7, verbose=tfdist.verbose(2), callbacks=[
    keras.callbacks.ModelCheckpoint(os.path.join(out, "ckpt-{epoch}.keras")),  # the chief's files only
    keras.callbacks.BackupAndRestore(os.path.join(out, "backup"))])            # resumes after a restart
tfdist.print(f"worker {tfdist.rank()} of {tfdist.num_workers()}, {tfdist.size()} replicas; saved in {out}")
