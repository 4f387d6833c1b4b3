"""`tfdist convert`: a tfds split into TFRecord shards, and a fast, clear failure when it cannot download."""

import os
import time

import numpy as np

from tfdist import cli, data


def test_convert_mock_tf_flowers_into_shards(tmp_path, capsys):
    out = tmp_path / "flowers"
    code = cli.main(["convert", "--dataset", "tf_flowers", "--split", "train", "--out", str(out), "--shards", "2",
                     "--source", "mock", "--num-examples", "6"])
    assert code == 0
    assert sorted(os.listdir(out)) == [".train.complete.json", "train-00000-of-00002.tfrecord",
                                       "train-00001-of-00002.tfrecord"]
    assert "wrote 6 records of tf_flowers (train) to 2 shards" in capsys.readouterr().out
    # tf_flowers images differ in size, so reading them needs image_size
    dataset = data.tfrecord_dataset(str(out / "train-*.tfrecord"), batch_size=6, image_size=(32, 32),
                                    features=["image", "label", "index"], shuffle=False)
    batch = next(iter(dataset))
    assert batch["image"].shape == (6, 32, 32, 3)
    assert sorted(batch["index"].numpy().tolist()) == list(range(6))
    assert np.all((batch["label"].numpy() >= 0) & (batch["label"].numpy() < 5))  # 5 flower classes


def test_failed_download_is_fast_and_points_to_mock_and_data_dir(tmp_path, capsys, monkeypatch):
    # An unreachable proxy makes every download fail at once, with or without internet.
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    start = time.monotonic()
    code = cli.main(["convert", "--dataset", "tf_flowers", "--out", str(tmp_path / "out"),
                     "--data-dir", str(tmp_path / "tfds")])
    assert code == 1
    assert time.monotonic() - start < 30
    error = capsys.readouterr().err
    assert "Could not download and prepare 'tf_flowers'" in error
    assert "--data-dir" in error and "--source mock" in error
    assert not (tmp_path / "out").exists()


def test_unknown_dataset(tmp_path, capsys):
    assert cli.main(["convert", "--dataset", "no_such_dataset", "--out", str(tmp_path)]) == 1
    assert "tfds has no dataset named 'no_such_dataset'" in capsys.readouterr().err
