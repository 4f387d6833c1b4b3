"""tfdist.data writing and reading: round trips, shard files, and a clear error for each bad input."""

import collections
import json
import os
import pathlib
import re
import threading
import time
import types

import numpy as np
import pytest
import tensorflow as tf

from tfdist import data

NUM = 24


def smooth_images(num, height=16, width=16, channels=3):
    """Gradients with a per-image offset: JPEG keeps them close (random noise it would not)."""
    y, x = np.mgrid[0:height, 0:width]
    base = (x * 6 + y * 4)[None, :, :, None] + 5 * np.arange(num)[:, None, None, None]
    return (base + np.arange(channels) * 20).clip(0, 255).astype(np.uint8)


def source():
    return {
        "image": smooth_images(NUM),
        "label": (np.arange(NUM) * 7 % 5).astype(np.int32),
        "score": np.random.default_rng(0).normal(size=(NUM, 2)).astype(np.float32),
        "name": np.array([f"item{i}\x00".encode() for i in range(NUM)], dtype=object),
    }


def read_all(pattern, **kwargs):
    """Every record, sorted by its index, as NumPy arrays per feature."""
    batches = list(data.tfrecord_dataset(pattern, batch_size=5, shuffle=False, **kwargs).as_numpy_iterator())
    merged = {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}
    order = np.argsort(merged["index"]) if "index" in merged else slice(None)
    return {key: value[order] for key, value in merged.items()}


@pytest.fixture(scope="module")
def jpeg_shards(tmp_path_factory):
    return data.write_tfrecords(source(), str(tmp_path_factory.mktemp("jpeg")), num_shards=4)


def test_shards_are_named_and_filled_round_robin(jpeg_shards):
    names = [os.path.basename(p) for p in jpeg_shards.paths]
    assert names == [f"data-0000{i}-of-00004.tfrecord" for i in range(4)]
    assert jpeg_shards.num_records == NUM
    assert sorted(os.listdir(os.path.dirname(jpeg_shards.paths[0]))) == [".data.complete.json"] + names  # no temporary
    assert [data.check_file(p).num_records for p in jpeg_shards.paths] == [6, 6, 6, 6]


def test_round_trip_labels_exact_jpeg_close(jpeg_shards):
    got, want = read_all(jpeg_shards.pattern), source()
    np.testing.assert_array_equal(got["index"], np.arange(NUM))
    np.testing.assert_array_equal(got["label"], want["label"])
    np.testing.assert_array_equal(got["score"], want["score"])  # float32 stored bit-exact
    assert got["name"].tolist() == want["name"].tolist()  # bytes kept whole, trailing NUL included
    assert got["image"].dtype == np.uint8 and got["image"].shape == (NUM, 16, 16, 3)
    error = np.abs(got["image"].astype(int) - want["image"])
    assert error.mean() < 2.5 and error.max() <= 16  # JPEG at quality 95, chroma subsampled


def test_png_round_trip_is_exact_and_grayscale_gets_a_channel(tmp_path):
    images = smooth_images(NUM, channels=1)[..., 0]  # (N, H, W)
    labels = np.arange(NUM)
    shards = data.write_tfrecords(tf.data.Dataset.from_tensor_slices((images, labels)), str(tmp_path),
                                  num_shards=3, image_format="png")
    got = read_all(shards.pattern)
    np.testing.assert_array_equal(got["image"], images[..., None])
    np.testing.assert_array_equal(got["label"], labels)


def test_features_parse_fn_resize_and_augment(jpeg_shards):
    dataset = data.tfrecord_dataset(jpeg_shards.pattern, batch_size=NUM, features=["image", "label"],
                                    image_size=(8, 10), augment=True, seed=0,
                                    parse_fn=lambda b: (tf.cast(b["image"], tf.float32) / 255, b["label"]))
    images, labels = next(iter(dataset))
    assert images.shape == (NUM, 8, 10, 3) and images.dtype == tf.float32
    assert sorted(labels.numpy().tolist()) == sorted(source()["label"].tolist())


def test_features_as_tf_io_specs(jpeg_shards):
    specs = {"image": tf.io.FixedLenFeature([], tf.string), "score": tf.io.FixedLenFeature([2], tf.float32)}
    batch = next(iter(data.tfrecord_dataset(jpeg_shards.pattern, batch_size=4, features=specs)))
    assert sorted(batch) == ["image", "score"]
    assert batch["image"].shape == (4, 16, 16, 3) and batch["score"].shape == (4, 2)


def test_images_of_different_sizes_need_image_size(tmp_path):
    sizes = tf.data.Dataset.range(4).map(lambda i: {"image": tf.zeros([4 + 2 * i, 6, 3], tf.uint8), "label": i})
    shards = data.write_tfrecords(sizes, str(tmp_path), num_shards=1)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"image_sizes_differ__pass_image_size/DecodeImage \[(6|8|10),6,3\] is not compatible with "
                             r"expected shape \[4,6,3\]"):
        read_all(shards.pattern)
    assert read_all(shards.pattern, image_size=(5, 5))["image"].shape == (4, 5, 5, 3)


def test_a_crash_leaves_no_shard_under_a_final_name(tmp_path):
    def examples():
        for i in range(10):
            if i == 7:
                raise RuntimeError("source died")
            yield {"image": np.full((4, 4, 3), i, np.uint8), "label": i}

    spec = {"image": tf.TensorSpec([4, 4, 3], tf.uint8), "label": tf.TensorSpec([], tf.int64)}
    with pytest.raises(tf.errors.UnknownError, match="source died"):
        data.write_tfrecords(tf.data.Dataset.from_generator(examples, output_signature=spec), str(tmp_path),
                             num_shards=2)
    assert os.listdir(tmp_path) == []


def test_existing_shards_need_overwrite(tmp_path):
    data.write_tfrecords(source(), str(tmp_path), num_shards=3)
    with pytest.raises(FileExistsError, match=r"already holds 3 shard\(s\) named data-NNNNN-of-NNNNN\.tfrecord, not a "
                                              r"complete write of these examples with these settings; pass "
                                              r"overwrite=True"):
        data.write_tfrecords(source(), str(tmp_path), num_shards=2)
    result = data.write_tfrecords(source(), str(tmp_path), num_shards=2, overwrite=True)
    assert sorted(str(p) for p in tmp_path.glob("*.tfrecord")) == sorted(result.paths)  # the 3 old shards are gone


@pytest.mark.parametrize("kwargs,message", [
    ({"num_shards": 0}, r"num_shards must be an int from 1 to 99999 \(shard names hold 5 digits\): "
                        r"received num_shards=0"),
    ({"num_shards": 100000}, r"num_shards must be an int from 1 to 99999 .*: received num_shards=100000"),
    ({"num_shards": 2, "image_format": "gif"}, r"Unknown image_format='gif'; choose one of \['jpeg', 'png'\]"),
    ({"num_shards": 2, "jpeg_quality": 0}, r"jpeg_quality must be an int from 1 to 100: received jpeg_quality=0"),
    ({"num_shards": 2, "prefix": "a/b"}, r"prefix must be .* received prefix='a/b'"),
    ({"num_shards": 2, "prefix": "a\\b"}, r"prefix must be .* glob characters .*: received prefix='a\\\\b'"),
])
def test_bad_writer_arguments(tmp_path, kwargs, message):
    with pytest.raises(data.DataError, match=message):
        data.write_tfrecords(source(), str(tmp_path), **kwargs)


@pytest.mark.parametrize("bad_source,message", [
    ({"x": np.zeros((3, 2, 2), np.float32)}, r"Feature 'x' has shape \(2, 2\) and dtype float32.*flatten"),
    ({"index": np.arange(3)}, r"already has a feature named 'index'"),
    ((np.zeros(3), np.zeros(3), np.zeros(3)), r"dict of arrays or an \(images, labels\) pair; received a tuple of 3"),
    ("images.npy", r"Cannot write a source of type str"),
    ({"image": np.zeros((3, 4, 4, 2), np.uint8)}, r"Image feature 'image' has 2 channels; jpeg stores \(1, 3\)"),
    (tf.data.Dataset.range(0).map(lambda i: {"label": i}), r"The source holds no example"),
])
def test_bad_sources(tmp_path, bad_source, message):
    with pytest.raises(data.DataError, match=message):
        data.write_tfrecords(bad_source, str(tmp_path), num_shards=1)
    assert not list(tmp_path.glob("*.tfrecord"))


def test_pattern_matching_no_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"file_pattern='.*nothing-\*' matches no file"):
        data.tfrecord_dataset(str(tmp_path / "nothing-*"), batch_size=4)


@pytest.mark.parametrize("spelling", ["./d/x-*.tfrecord", "{tmp}/d/x-*.tfrecord", "d//x-*.tfrecord"])
def test_a_file_named_two_ways_is_read_once_an_epoch(tmp_path, monkeypatch, spelling):
    """"d/x-0" and a pattern spelled "./d/x-*" (or absolute) name one file: it was read twice each epoch."""
    data.write_tfrecords({"label": np.arange(10)}, str(tmp_path / "d"), num_shards=2, prefix="x")
    monkeypatch.chdir(tmp_path)
    labels = read_all(["d/x-00000-of-00002.tfrecord", spelling.format(tmp=tmp_path)])["label"].tolist()
    assert sorted(labels) == list(range(10))


@pytest.mark.parametrize("typo", ["d/typo-*.tfrecord", "d/x-0000[7-9]-*"])
def test_a_pattern_of_a_list_that_matches_no_file_is_refused_naming_it(tmp_path, monkeypatch, typo):
    """It was dropped silently, on every worker alike: the dataset read fewer files."""
    data.write_tfrecords({"label": np.arange(10)}, str(tmp_path / "d"), num_shards=2, prefix="x")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"^file_pattern=\['d/x-00000-of-00002\.tfrecord', '{re.escape(typo)}'\] "
                                                rf"names '{re.escape(typo)}', which matches no file\.$"):
        data.tfrecord_dataset(["d/x-00000-of-00002.tfrecord", typo], batch_size=2)


def test_a_file_whose_name_starts_with_a_dot_is_read_when_named_and_left_out_by_a_pattern(tmp_path):
    data.write_tfrecords({"label": np.arange(3)}, str(tmp_path), num_shards=1, prefix=".hidden")
    data.write_tfrecords({"label": np.arange(3, 5)}, str(tmp_path), num_shards=1, prefix="shown")
    named = str(tmp_path / ".hidden-00000-of-00001.tfrecord")
    assert read_all(named)["label"].tolist() == [0, 1, 2]
    assert read_all(str(tmp_path / "*.tfrecord"))["label"].tolist() == [3, 4]


def test_every_form_of_file_list_reads_the_same_records(tmp_path):
    """A pattern, a list of names (in any order), a list of patterns, a tf.data.Dataset.list_files (shuffled)."""
    written = data.write_tfrecords({"label": np.arange(20)}, str(tmp_path), num_shards=4)
    names = list(written.paths)
    forms = [written.pattern, names[::-1], [str(tmp_path / "data-0000[0-1]-*"), str(tmp_path / "data-0000[2-3]-*")],
             tf.data.Dataset.list_files(written.pattern), [pathlib.Path(name) for name in names]]
    for form in forms:
        assert read_all(form)["label"].tolist() == list(range(20)), form


@pytest.mark.parametrize("file_pattern, error, message", [
    (lambda names: tf.data.Dataset.range(3), data.DataError,
     r"file_pattern as a tf\.data\.Dataset must yield file names \(scalar strings, as tf\.data\.Dataset\.list_files "
     r"does\): received one of TensorSpec\(shape=\(\), dtype=tf\.int64"),
    (lambda names: tf.data.Dataset.from_tensor_slices(names).repeat(), data.DataError,
     r"file_pattern is an endless tf\.data\.Dataset of file names \(a repeat\?\): pass the files once"),
    (lambda names: [], data.DataError, r"file_pattern must be a glob pattern, a non-empty list of patterns or file "
                                       r"names, or a tf\.data\.Dataset of file names: received file_pattern=\[\]\."),
    (lambda names: [names[0], 3], data.DataError, r"received file_pattern=\['.*', 3\]\.$"),
    (lambda names: 7, data.DataError, r"received file_pattern=7\.$"),
    (lambda names: names + [names[0] + ".gone"], FileNotFoundError,
     r"file_pattern=\[.*\] names '.*data-00000-of-00002\.tfrecord\.gone', which does not exist\.$"),
])
def test_a_file_list_of_another_kind_or_naming_a_missing_file_is_refused_naming_it(tmp_path, file_pattern, error,
                                                                                 message):
    names = list(data.write_tfrecords({"label": np.arange(4)}, str(tmp_path), num_shards=2).paths)
    with pytest.raises(error, match=message):
        data.tfrecord_dataset(file_pattern(names), batch_size=2)


@pytest.mark.parametrize("batch_size", [0, -4, 2.5, True])
def test_batch_size_must_be_positive(jpeg_shards, batch_size):
    with pytest.raises(data.DataError, match=rf"batch_size must be a positive int: received batch_size={batch_size}"):
        data.tfrecord_dataset(jpeg_shards.pattern, batch_size=batch_size)


def test_missing_feature_names_the_key(jpeg_shards):
    with pytest.raises(data.DataError, match=r"Feature\(s\) \['labels'\] .* hold \['image', 'index', 'label', 'name'"):
        data.tfrecord_dataset(jpeg_shards.pattern, batch_size=4, features=["image", "labels"])


def damaged_copy(shards, directory: pathlib.Path, damage):
    """The shards copied into ``directory``, the last one replaced by ``damage(bytes)``."""
    for path in shards.paths:
        content = pathlib.Path(path).read_bytes()
        last = path == shards.paths[-1]
        (directory / os.path.basename(path)).write_bytes(damage(content) if last else content)
    return str(directory / os.path.basename(shards.paths[-1])), str(directory / "data-*.tfrecord")


def test_non_tfrecord_file_is_named(jpeg_shards, tmp_path):
    bad, pattern = damaged_copy(jpeg_shards, tmp_path, lambda content: b"label,image\n1,cat.jpg\n" * 10)
    with pytest.raises(data.DataError, match=rf"Cannot read {bad}: not a TFRecord file.*skip_corrupt=True"):
        data.tfrecord_dataset(pattern, batch_size=4)


def test_truncated_file_is_named_or_skipped_and_counted(jpeg_shards, tmp_path):
    bad, pattern = damaged_copy(jpeg_shards, tmp_path, lambda content: content[:-100])
    with pytest.raises(data.DataError, match=rf"Cannot read {bad}: truncated: record 5 at byte \d+ needs"):
        data.tfrecord_dataset(pattern, batch_size=4)
    with pytest.warns(UserWarning, match=r"skipped damaged data in 1 of 4 file\(s\), keeping 5 record\(s\)"):
        dataset = data.tfrecord_dataset(pattern, batch_size=4, skip_corrupt=True)
    seen = sorted(int(i) for batch in dataset for i in batch["index"].numpy())
    assert seen == sorted(set(range(NUM)) - {NUM - 1})  # the last shard's last record (index 23) is lost


@pytest.mark.parametrize("kwargs,message", [
    ({"image_size": (0, 4)}, r"image_size must be \(height, width\) in positive ints or None: received \(0, 4\)"),
    ({"repeat": -1}, r"repeat must be True, False or a positive number of epochs: received repeat=-1"),
    ({"shuffle_buffer": 0}, r"shuffle_buffer must be a positive int: received shuffle_buffer=0"),
    ({"seed": 7.5}, r"seed must be an int \(the same on every worker\) or None: received seed=7.5"),
    ({"cache": ""}, r"cache must be False, True \(memory\) or a file path prefix: received cache=''"),
])
def test_bad_reader_arguments(jpeg_shards, kwargs, message):
    with pytest.raises(data.DataError, match=message):
        data.tfrecord_dataset(jpeg_shards.pattern, batch_size=4, **kwargs)


def test_a_set_being_replaced_is_refused_until_complete(tmp_path, monkeypatch):
    """overwrite=True never exposes a half-replaced set: readers are refused until the last shard is in place."""
    from tfdist.data import writer

    data.write_tfrecords({"label": np.arange(12)}, str(tmp_path), num_shards=4)
    moving, go = threading.Event(), threading.Event()
    monkeypatch.setattr(writer, "_before_each_move", lambda: (moving.set(), go.wait(60)))
    results = []
    thread = threading.Thread(target=lambda: results.append(
        data.write_tfrecords({"label": np.arange(100, 112)}, str(tmp_path), num_shards=4, overwrite=True)))
    thread.start()
    assert moving.wait(60)
    with pytest.raises(data.DataError, match=r"The shards data-NNNNN-of-NNNNN\.tfrecord in .* are being written or "
                                             r"replaced by write_tfrecords now \(.*\.tmp-data-\w+ is there\).*delete"):
        data.tfrecord_dataset(str(tmp_path / "data-*.tfrecord"), batch_size=4)
    assert not (tmp_path / ".data.complete.json").exists()  # no completion marker while shards move
    go.set()
    thread.join(60)
    assert sorted(read_all(str(tmp_path / "data-*.tfrecord"))["label"]) == list(range(100, 112))
    marker = json.loads((tmp_path / ".data.complete.json").read_text())
    assert sorted(marker["sizes"]) == [os.path.basename(p) for p in results[0].paths] and marker["num_records"] == 12


def test_a_write_killed_midway_blocks_reading_until_the_next_write(tmp_path):
    data.write_tfrecords({"label": np.arange(6)}, str(tmp_path), num_shards=2)
    (tmp_path / ".tmp-data-0123abcd").mkdir()  # what a write killed while moving shards leaves
    with pytest.raises(data.DataError, match=r"If no write is running \(one was killed\), delete .*\.tmp-data-0123abcd"):
        data.tfrecord_dataset(str(tmp_path / "data-*.tfrecord"), batch_size=2)
    data.write_tfrecords({"label": np.arange(6)}, str(tmp_path), num_shards=2, overwrite=True)
    assert sorted(read_all(str(tmp_path / "data-*.tfrecord"))["label"]) == list(range(6))


def test_the_same_examples_are_not_rewritten(tmp_path):
    first = data.write_tfrecords(source(), str(tmp_path), num_shards=2)
    times = [os.stat(p).st_mtime_ns for p in first.paths]
    again = data.write_tfrecords(source(), str(tmp_path), num_shards=2, overwrite=True)
    assert again == first and [os.stat(p).st_mtime_ns for p in first.paths] == times
    changed = source()
    changed["label"][5] += 1
    data.write_tfrecords(changed, str(tmp_path), num_shards=2, overwrite=True)
    assert read_all(str(tmp_path / "data-*.tfrecord"))["label"][5] == changed["label"][5]


def test_the_other_workers_wait_for_the_chiefs_write(tmp_path, monkeypatch, capfd):
    """Worker 1 (here a thread) calls write_tfrecords first: it returns only once the chief's shards are complete."""
    from tfdist.data import writer

    waiting, finished = threading.Event(), writer._finished
    monkeypatch.setattr(writer, "_finished", lambda *args: (waiting.set(), finished(*args))[1])
    monkeypatch.setattr(writer, "_NOTE_EVERY_S", 0.5)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                                                "task": {"type": "worker", "index": 1}}))
    results = []
    worker_1 = threading.Thread(target=lambda: results.append(data.write_tfrecords(source(), str(tmp_path),
                                                                                   num_shards=2, overwrite=True)))
    worker_1.start()
    assert waiting.wait(60)
    time.sleep(1)
    assert results == [] and not list(tmp_path.glob("*.tfrecord"))
    monkeypatch.delenv("TF_CONFIG")
    chief = data.write_tfrecords(source(), str(tmp_path), num_shards=2, overwrite=True)
    worker_1.join(60)
    assert results == [chief]
    assert re.search(r"worker 1 has waited \d+ s for worker 0's shards of these examples in .*: every worker must see "
                     r"that directory \(a shared filesystem\), and read the same examples in the same order \(an "
                     r"unseeded shuffle or tfds shuffle_files=True differs per process: seed it, or write on worker 0 "
                     r"only\)", capfd.readouterr().err)


@pytest.mark.parametrize("prefix,longer", [("mnist", "mnist-test"), ("a", "a-0"), ("a", "a-00001-of-00002")])
def test_a_prefix_owns_exactly_its_shards(tmp_path, prefix, longer):
    """A prefix that another prefix starts with: neither lists, overwrites, deletes nor reads the other's shards."""
    other = data.write_tfrecords({"label": np.arange(100, 106)}, str(tmp_path), num_shards=2, prefix=longer)
    mine = data.write_tfrecords({"label": np.arange(4)}, str(tmp_path), num_shards=2, prefix=prefix)
    assert sorted(tf.io.gfile.glob(mine.pattern)) == list(mine.paths)
    assert sorted(read_all(mine.pattern)["label"]) == [0, 1, 2, 3]
    replaced = data.write_tfrecords({"label": np.arange(5)}, str(tmp_path), num_shards=3, prefix=prefix, overwrite=True)
    assert sorted(read_all(replaced.pattern)["label"]) == [0, 1, 2, 3, 4]
    assert sorted(read_all(other.pattern)["label"]) == list(range(100, 106))
    assert sorted(os.listdir(tmp_path)) == sorted([f".{prefix}.complete.json", f".{longer}.complete.json"]
                                                  + [os.path.basename(p) for p in replaced.paths + other.paths])


def test_writing_a_prefix_never_blocks_reading_a_longer_one(tmp_path, monkeypatch):
    """While "mnist" shards move into place, "mnist-test" shards stay readable."""
    from tfdist.data import writer

    test = data.write_tfrecords({"label": np.arange(4)}, str(tmp_path), num_shards=2, prefix="mnist-test")
    moving, go = threading.Event(), threading.Event()
    monkeypatch.setattr(writer, "_before_each_move", lambda: (moving.set(), go.wait(60)))
    thread = threading.Thread(target=lambda: data.write_tfrecords({"label": np.arange(8)}, str(tmp_path), num_shards=2,
                                                                  prefix="mnist", overwrite=True))
    thread.start()
    try:
        assert moving.wait(60)
        assert sorted(read_all(test.pattern)["label"]) == [0, 1, 2, 3]
    finally:
        go.set()
        thread.join(60)


def test_a_rerun_without_overwrite_returns_the_complete_set_or_refuses_other_examples(tmp_path):
    first = data.write_tfrecords({"label": np.arange(6)}, str(tmp_path), num_shards=2)
    times = [os.stat(p).st_mtime_ns for p in first.paths]
    assert data.write_tfrecords({"label": np.arange(6)}, str(tmp_path), num_shards=2) == first
    assert [os.stat(p).st_mtime_ns for p in first.paths] == times  # not rewritten
    with pytest.raises(FileExistsError, match=r"already holds 2 shard\(s\) named data-NNNNN-of-NNNNN\.tfrecord, not a "
                                              r"complete write of these examples with these settings; pass "
                                              r"overwrite=True"):
        data.write_tfrecords({"label": np.arange(7)}, str(tmp_path), num_shards=2)


@pytest.fixture
def worker_1_after_the_chief(monkeypatch):
    """A store shared in this process (tfdist.kvstore over a dict); calling the fixture's value turns this process
    into worker 1 of 2 making its first write_tfrecords call, after the chief's calls made here."""
    from tfdist.data import agreement, writer

    values = {}
    monkeypatch.setattr(agreement, "_calls", collections.Counter())  # the chief's calls: this process's from here
    monkeypatch.setattr(writer, "kvstore", types.SimpleNamespace(
        available=lambda: True, get=lambda key, timeout_ms=500: values.get(key), put=values.__setitem__))

    def become_worker_1():
        monkeypatch.setattr(agreement, "_calls", collections.Counter())
        monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["localhost:1", "localhost:2"]},
                                                    "task": {"type": "worker", "index": 1}}))
    return become_worker_1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("labels,message", [
    (np.arange(12)[::-1], r"worker 1 read the same 12 examples as worker 0 in another order: the source's order "
                          r"differs between workers \(e\.g\. an unseeded shuffle or tfds shuffle_files=True\)\. Seed "
                          r"it \(dataset\.shuffle\(n, seed=S\)"),
    (np.arange(1, 14), r"worker 1 read other examples than worker 0 \(13 examples; worker 0 read 12\): the source's "
                       r"content differs between workers.*write on worker 0 only"),
])
def test_a_worker_whose_examples_differ_from_the_chiefs_fails_naming_why(tmp_path, worker_1_after_the_chief, labels,
                                                                        message):
    """Worker 1 compares its examples with what the chief published, and fails at once instead of waiting."""
    data.write_tfrecords({"label": np.arange(12)}, str(tmp_path), num_shards=2)
    worker_1_after_the_chief()
    with pytest.raises(data.DataError, match=message):
        data.write_tfrecords({"label": labels.copy()}, str(tmp_path), num_shards=2)


@pytest.mark.timeout(60)
def test_a_worker_whose_call_differs_from_the_chiefs_is_told_at_once_naming_the_arguments(tmp_path,
                                                                                        worker_1_after_the_chief):
    """Issue 49: the calls were keyed by their arguments, so worker 1's call with other ones waited for ever."""
    data.write_tfrecords({"label": np.arange(12)}, str(tmp_path), num_shards=2)
    worker_1_after_the_chief()
    with pytest.raises(data.DataError, match=r"^write_tfrecords: worker 1's call 1 of write_tfrecords differs from "
                                             r"worker 0's call 1: prefix='train' \(worker 0: 'data'\), num_shards=3 "
                                             r"\(worker 0: 2\)\. Every worker must make the same write_tfrecords "
                                             r"calls in the same order \(or call it on worker 0 only, then "
                                             r"tfdist\.collectives\.barrier\(\)\)\.$"):
        data.write_tfrecords({"label": np.arange(12)}, str(tmp_path), num_shards=3, prefix="train")


@pytest.mark.timeout(60)
def test_a_worker_that_mounts_the_directory_elsewhere_follows_the_chief(tmp_path, worker_1_after_the_chief):
    """out_dir is not compared: worker 1 reaches worker 0's directory by another path and returns its shards."""
    written = data.write_tfrecords({"label": np.arange(12)}, str(tmp_path / "shards"), num_shards=2)
    (tmp_path / "mount").symlink_to(tmp_path / "shards")
    worker_1_after_the_chief()
    followed = data.write_tfrecords({"label": np.arange(12)}, str(tmp_path / "mount"), num_shards=2)
    assert followed.num_records == written.num_records == 12
    assert [os.path.basename(p) for p in followed.paths] == [os.path.basename(p) for p in written.paths]


@pytest.mark.timeout(60)
def test_a_worker_fails_when_the_chiefs_write_failed(tmp_path, worker_1_after_the_chief):
    with pytest.raises(data.DataError, match="holds no example"):
        data.write_tfrecords({"label": np.arange(0)}, str(tmp_path), num_shards=2)
    worker_1_after_the_chief()
    with pytest.raises(data.DataError, match=r"^Worker 0 could not write these examples \(DataError: The source holds "
                                             r"no example: nothing to write\.\); its output says why\.$"):
        data.write_tfrecords({"label": np.arange(3)}, str(tmp_path), num_shards=2)
