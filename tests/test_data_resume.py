"""A fit resumed mid-epoch reads the rest of that epoch's records once, whatever worker counts read the start.

In-process cases build each worker's pipeline with its own InputContext and global seed, read the records a
run would have trained on, and resume the next run where ``BackupAndRestore`` would (``tfdist.fit_start``,
as the resumed fit opens it). The records each run really read are counted; nothing is simulated by the test.
Two real jobs then do it through ``tfdist run``: 2 workers die mid-epoch, 3 resume and die, 2 finish; and 2
resume 2. Their model counts how often each record was trained on (see ``resume_records_job.py``).
"""

import collections
import json
import os
import warnings

import keras

import numpy as np
import pytest
import tensorflow as tf

from tests.jobs import run_job
from tfdist import data
from tfdist import fit_start
from tfdist.data import epochs

RECORDS, GLOBAL_BATCH = 96, 12
STEPS = RECORDS // GLOBAL_BATCH  # one epoch of the fit is one pass over the records


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The 96 records (label = number) in 6 files, in 2 (fewer files than 3 pipelines), in 5 (which neither 2 nor 3
    divides) and in 7 of unequal sizes."""
    root = tmp_path_factory.mktemp("resume")
    found = {n: data.write_tfrecords({"label": np.arange(RECORDS)}, str(root / str(n)), num_shards=n).pattern
             for n in (6, 2, 5)}
    found["7_unequal"] = write_unequal_shards(root / "7_unequal", [4, 25, 7, 18, 14, 20, 8])
    return found


def pipeline(pattern, worker, workers, seed=5, **options):
    tf.random.set_seed(100 + worker)  # every worker's own global seed
    context = tf.distribute.InputContext(workers, worker, workers)
    return data.tfrecord_dataset(pattern, batch_size=GLOBAL_BATCH, input_context=context, repeat=True, seed=seed,
                                 features=["label"], **options)


def first_records(dataset, count):
    found = []
    for batch in dataset:
        found += batch["label"].numpy().tolist()
        if len(found) >= count:
            return found[:count]


def run(pattern, workers, resume, steps, **options):
    """What each worker of a run trains on from ``resume`` through step ``steps`` of the epoch: the records
    after those the resumed fit skips (``resume.steps`` steps' worth)."""
    per_step = GLOBAL_BATCH // workers
    trained = []
    for worker in range(workers):
        dataset = pipeline(pattern, worker, workers, **options)
        with fit_start.opened(fit_start.Start(resume, STEPS)):
            found = first_records(dataset, steps * per_step)
        trained.append(found[(resume.steps if resume else 0) * per_step:])
    return trained


CHAINS = {  # files: the runs' (workers, steps done when each stopped), the last finishing epoch 2 (index 1)
    "2_then_3": (6, [(2, 3), (3, STEPS)]),
    "2_then_3_then_2": (6, [(2, 3), (3, 5), (2, STEPS)]),
    "3_then_2_then_3": (6, [(3, 2), (2, 7), (3, STEPS)]),
    "same_count": (6, [(2, 3), (2, 6), (2, STEPS)]),
    "record_level_3_then_2": (2, [(3, 1), (2, STEPS)]),
    "2_then_record_level_3": (2, [(2, 5), (3, STEPS)]),
    # issue 49: the shares of 5 files on 2 workers were 3 and 2 files, so 7 steps took one past its share
    "5_files_2_then_3": (5, [(2, 7), (3, STEPS)]),
    "5_files_3_then_2_then_3": (5, [(3, 7), (2, 7), (3, STEPS)]),
    "7_unequal_files_2_then_3_then_2": ("7_unequal", [(2, 3), (3, 5), (2, STEPS)]),
    "7_unequal_files_same_count": ("7_unequal", [(3, 3), (3, 6), (3, STEPS)]),
}


@pytest.mark.parametrize("chain", CHAINS)
def test_every_record_of_the_resumed_epoch_is_read_once(shards, chain):
    files, runs = CHAINS[chain]
    pattern, epoch, seen, layouts, done = shards[files], 1, [], (), 0
    for workers, steps in runs:
        resume = fit_start.Resume(epoch, done, layouts) if (done or epoch) else None
        trained = run(pattern, workers, resume, steps)
        assert len({len(t) for t in trained}) == 1, [len(t) for t in trained]  # in lock-step
        seen += [record for worker in trained for record in worker]
        layouts = () if len(layouts) == 1 and layouts[0][0] == workers else layouts  # the same stream went on
        layouts, done = layouts + ((workers, steps, GLOBAL_BATCH, epochs.SPLIT),), steps
    assert sorted(seen) == list(range(RECORDS)), collections.Counter(seen).most_common(3)


def test_a_resume_at_an_epoch_boundary_reads_that_data_epoch(shards):
    fresh = first_records(pipeline(shards[6], 0, 2), 2 * RECORDS // 2)
    resumed = run(shards[6], 2, fit_start.Resume(1, 0, ()), STEPS)[0]
    assert resumed == fresh[RECORDS // 2:]  # the file order and record shuffle of epoch 2, not of epoch 1


def test_the_order_does_not_depend_on_the_process_global_seed(shards):
    first = first_records(pipeline(shards[6], 1, 3), RECORDS)
    tf.random.set_seed(7)
    context = tf.distribute.InputContext(3, 1, 3)
    again = first_records(data.tfrecord_dataset(shards[6], batch_size=GLOBAL_BATCH, input_context=context,
                                                repeat=True, seed=5, features=["label"]), RECORDS)
    assert first == again


def test_every_iterator_started_in_the_window_takes_the_position_and_none_after_it(shards):
    """Datasets zipped for training (or one pipeline per replica) all start there; once the first batch ended
    (``fit_start.close``), a validation dataset's iterator starts at its own beginning."""
    first, second, validation = (pipeline(shards[6], 0, 2) for _ in range(3))
    fresh = first_records(pipeline(shards[6], 0, 2), 2 * RECORDS // 2)
    with fit_start.opened(fit_start.Start(fit_start.Resume(1, 0, ()), STEPS)):
        assert first_records(first, 6) == first_records(second, 6) == fresh[RECORDS // 2:][:6]
        fit_start.close()
        assert first_records(validation, 6) == fresh[:6]
    assert fit_start.training_layout() == (2, GLOBAL_BATCH, epochs.SPLIT)


@pytest.mark.parametrize("why, options, steps_per_epoch, earlier", [
    ("only with tfrecord_dataset\\(seed=...\\)", {"seed": None}, STEPS, 3),
    ("not one pass over the 96 records", {}, STEPS - 1, 3),
])
def test_a_resume_that_cannot_be_exact_says_why(shards, why, options, steps_per_epoch, earlier):
    dataset = pipeline(shards[6], 0, 2, **options)
    with pytest.warns(UserWarning, match=f"resumed at step 3 of epoch 2 may read some records of that epoch twice "
                                         f"and others not at all: .*{why}"):
        resume = fit_start.Resume(1, 3, ((earlier, 3, GLOBAL_BATCH, epochs.SPLIT),))
        with fit_start.opened(fit_start.Start(resume, steps_per_epoch)):
            first_records(dataset, 12)


def test_a_fit_from_the_start_warns_nothing(shards):
    dataset = pipeline(shards[6], 0, 2, seed=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fit_start.opened(fit_start.Start(None, STEPS)):
            first_records(dataset, 12)


def test_a_changed_global_batch_reads_the_records_not_read_yet_and_says_the_epoch_ends_by_steps(shards):
    """2 workers at a global batch of 12 read 3 steps; 2 workers at 24 resume: the 36 records read are known by
    the batch they were read with, and the rest are read once; the steps no longer add up to the records."""
    read = [r for w in run(shards[6], 2, fit_start.Resume(1, 0, ()), 3) for r in w]
    pattern, per_step = shards[6], 24 // 2
    rest = []
    with pytest.warns(UserWarning, match="steps were of a global batch of 12, this fit's are of 24; it reads the "
                                         "records not read yet, but its epoch ends by steps, not by records"):
        for worker in range(2):
            tf.random.set_seed(worker)
            dataset = data.tfrecord_dataset(pattern, batch_size=24, input_context=tf.distribute.InputContext(
                2, worker, 2), repeat=True, seed=5, features=["label"])
            with fit_start.opened(fit_start.Start(fit_start.Resume(1, 3, ((2, 3, 12, epochs.SPLIT),)), RECORDS // 24)):
                rest += first_records(dataset, 3 * per_step + 30)[3 * per_step:]
    assert sorted(read + rest) == list(range(RECORDS))


def counter_model():
    """One zero row per record; the loss is the row: SGD(1) lowers a record's row by 1 / batch each time."""
    ids = keras.Input((), dtype="int64")
    model = keras.Model(ids, keras.layers.Embedding(RECORDS, 1, embeddings_initializer="zeros")(ids))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=lambda y, rows: rows)
    return model


class DieAt(keras.callbacks.Callback):
    def __init__(self, epoch, step):
        super().__init__()
        self.at = (epoch, step)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch + 1) == self.at:
            raise RuntimeError("killed")


@pytest.mark.parametrize("initial_epoch", [0, 1])
def test_a_restarted_fit_from_a_given_initial_epoch_trains_each_record_once(shards, tmp_path, initial_epoch):
    """fit(initial_epoch=1) reads data epoch 1 from its start, as the restart from its backup does: the run
    killed after 3 steps and the restart train each record once (the restart read epoch 1, the run epoch 0)."""
    def fit(model, callbacks):
        dataset = data.tfrecord_dataset(shards[6], batch_size=GLOBAL_BATCH, repeat=True, seed=5, features=["label"],
                                        parse_fn=lambda b: (b["label"], tf.zeros_like(b["label"], "float32")))
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
        model.fit(dataset, initial_epoch=initial_epoch, epochs=initial_epoch + 1, steps_per_epoch=STEPS, verbose=0,
                  callbacks=[backup] + callbacks)

    with pytest.raises(RuntimeError, match="killed"):
        fit(counter_model(), [DieAt(initial_epoch, 3)])
    metadata = json.loads((tmp_path / "backup" / "training_metadata.json").read_text())
    assert metadata["data_layouts_in_epoch"] == [[1, 3, GLOBAL_BATCH, "parts"]]
    model = counter_model()
    fit(model, [])
    times = collections.Counter(np.round(-model.get_weights()[0][:, 0] * GLOBAL_BATCH, 4).tolist())
    assert times == {1.0: RECORDS}, times


def test_a_validation_dataset_never_takes_the_training_start(shards):
    """The training data is NumPy, the validation data a repeating tfrecord_dataset, and the first step stops the
    fit (stop_training): the validation reads its own first epoch, not the fit's epoch 2 (initial_epoch=1)."""
    class StopAtFirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.stop_training = True

    validation = data.tfrecord_dataset(shards[6], batch_size=GLOBAL_BATCH, repeat=True, seed=5, features=["label"],
                                       parse_fn=lambda b: (b["label"], tf.cast(b["label"], "float32")))
    expected = float(np.mean([y for batch in validation.take(2) for y in batch[1].numpy()]))
    ids = keras.Input((), dtype="int64")
    model = keras.Model(ids, keras.layers.Embedding(RECORDS, 1, embeddings_initializer="zeros")(ids))
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=lambda y, rows: tf.reshape(y, [-1, 1]) + 0.0 * rows)
    x = np.arange(RECORDS)
    history = model.fit(x, x.astype("float32"), batch_size=GLOBAL_BATCH, initial_epoch=1, epochs=2,
                        steps_per_epoch=STEPS, validation_data=validation, validation_steps=2, verbose=0,
                        callbacks=[StopAtFirstStep()])  # steps_per_epoch: Keras keeps the epoch's generator
    assert history.history["val_loss"] == [pytest.approx(expected)]


@pytest.fixture(scope="module")
def job_shards(tmp_path_factory):
    return data.write_tfrecords({"label": np.arange(RECORDS)}, str(tmp_path_factory.mktemp("job_shards")),
                                num_shards=6).pattern


@pytest.mark.parametrize("runs", [((2, "1:3"), (3, "1:5"), (2, "-")), ((2, "1:3"), (2, "-"))],
                         ids=["2_then_3_then_2", "2_then_2"])
def test_a_job_resumed_mid_epoch_trains_on_every_record_once_per_epoch(job_shards, tmp_path, runs):
    """Keras' BackupAndRestore(save_freq=1); the chief dies right after a step's backup; 2 epochs in all, so
    every record's row must have fallen by exactly 2 / global batch, on every worker (one device's result)."""
    for workers, stop in runs:
        result = run_job("resume_records_job.py", tmp_path, job_shards, str(RECORDS), str(GLOBAL_BATCH), stop,
                         num_workers=workers, timeout=240)
        if stop != "-":
            assert result.returncode != 0 and "worker 0 exited with code 3" in result.output, result.output[-3000:]
    result.check()
    assert sorted(result.results) == list(range(runs[-1][0]))
    for rank, found in result.results.items():
        times = collections.Counter(round(-row * GLOBAL_BATCH, 4) for row in found["rows"])
        assert times == {2.0: RECORDS}, (rank, times)


def test_a_repeating_dataset_passed_to_fit_without_distribute_can_be_auto_sharded(shards):
    """``model.fit(tfrecord_dataset(..., repeat=True))`` under a multi-worker strategy: TensorFlow's auto-shard
    finds no file source (the reading is inside the epochs' functions) and shards by batch, as it did before the
    dataset learned where to start (a one-element source read as a list of 1 file failed: "not enough for the
    required 2 shards")."""
    from tensorflow.python.data.experimental.ops import distribute as tf_distribute

    dataset = data.tfrecord_dataset(shards[6], batch_size=6, repeat=True, seed=5, features=["label"])
    halves = [first_records(tf_distribute._AutoShardDataset(dataset, 2, index), 48) for index in (0, 1)]
    assert sorted(halves[0] + halves[1]) == list(range(RECORDS))


def write_unequal_shards(directory, sizes):
    """Records 0, 1, ... (``label``) in one file per size: ``data-0000i-of-0000n.tfrecord``."""
    directory.mkdir(parents=True, exist_ok=True)
    first = 0
    for index, size in enumerate(sizes):
        with tf.io.TFRecordWriter(str(directory / f"data-{index:05d}-of-{len(sizes):05d}.tfrecord")) as writer:
            for label in range(first, first + size):
                writer.write(tf.train.Example(features=tf.train.Features(feature={"label": tf.train.Feature(
                    int64_list=tf.train.Int64List(value=[label]))})).SerializeToString())
        first += size
    return str(directory / "data-*.tfrecord")


ISSUE_RECORDS, ISSUE_BATCH = 120, 12  # the issue's 120 records; 10 steps of 12 an epoch (2 and 3 divide 12)


@pytest.mark.parametrize("sizes", [[24] * 5, [5, 30, 8, 22, 17, 26, 12]], ids=["5_shards", "7_unequal_shards"])
def test_a_job_preempted_on_2_workers_and_resumed_on_3_trains_every_record_once_per_epoch(tmp_path, sizes):
    """Issue 49: SIGTERM to `tfdist run -n 2` in epoch 1 (exit 85), then the same command with -n 3, 3 epochs: with
    5 shards records were trained 1, 2, 3 and 4 times (the workers' shares of an epoch differed: 3 files and 2)."""
    if len(set(sizes)) == 1:
        pattern = data.write_tfrecords({"label": np.arange(ISSUE_RECORDS)}, str(tmp_path / "shards"),
                                       num_shards=len(sizes)).pattern
    else:
        pattern = write_unequal_shards(tmp_path / "shards", sizes)
    job = tmp_path / "job"
    for workers, stop in ((2, "1:4"), (3, "-")):
        result = run_job("resume_records_job.py", job, pattern, str(ISSUE_RECORDS), str(ISSUE_BATCH), stop, "3", "3",
                         "sigterm", num_workers=workers, timeout=300)
        if stop != "-":
            assert result.returncode == 85, result.output[-3000:]
    result.check()
    assert sorted(result.results) == [0, 1, 2]
    for rank, found in result.results.items():
        times = collections.Counter(round(-row * ISSUE_BATCH, 4) for row in found["rows"])
        assert times == {3.0: ISSUE_RECORDS}, (rank, times)


def test_a_backup_whose_runs_split_the_epoch_another_way_says_so(shards):
    """A backup written by a tfdist before equal parts records runs of 3 fields: their workers read whole files
    (every N-th of the epoch's order), so the replay of them with today's split would name other records."""
    dataset = pipeline(shards[6], 0, 3)
    with pytest.warns(UserWarning, match=r"resumed at step 3 of epoch 2 may read some records of that epoch twice "
                                         r"and others not at all: its earlier runs split the epoch's records another "
                                         r"way \(a backup of an older tfdist\)"):
        with fit_start.opened(fit_start.Start(fit_start.Resume(1, 3, ((2, 3, GLOBAL_BATCH),)), STEPS)):
            first_records(dataset, 12)
