"""Gradient bucket plans (tfdist.buckets): reverse layer order, a small first bucket, the settings' errors."""

import subprocess
import sys

import pytest

from tfdist import buckets

KIB, MIB = 1 << 10, 1 << 20


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch):
    monkeypatch.setattr(buckets, "_settings", {})
    monkeypatch.delenv(buckets.ENV, raising=False)


def test_buckets_run_from_the_last_gradient_with_a_small_first_bucket():
    # a CNN's gradients in variable order: conv1 kernel, bias, conv2 kernel, bias, dense1 kernel, bias, dense2 kernel, bias
    sizes = [3456, 128, 73728, 256, 1179648, 512, 5120, 40]
    assert buckets.plan(sizes, 4 * MIB, 1 * MIB) == [[4, 5, 6, 7], [0, 1, 2, 3]]
    assert buckets.plan(sizes, 64 * KIB, 4 * KIB) == [[6, 7], [4, 5], [2, 3], [0, 1]]


def test_a_gradient_larger_than_a_bucket_gets_its_own():
    assert buckets.plan([10, 100, 10, 10], 20, 20) == [[2, 3], [1], [0]]


def test_zero_means_one_all_reduce_of_everything():
    assert buckets.plan([5, 6, 7], 0, 0) == [[0, 1, 2]]
    assert buckets.plan([], 0, 0) == [] and buckets.plan([], 10, 10) == []


def test_every_gradient_is_in_exactly_one_bucket():
    sizes = [(i * 7919) % 5000 + 1 for i in range(200)]
    plan = buckets.plan(sizes, 20000, 3000)
    assert sorted(i for bucket in plan for i in bucket) == list(range(200))
    assert [max(b) for b in plan] == sorted((max(b) for b in plan), reverse=True)  # last layers first


def test_defaults_and_set_bucket_bytes():
    assert buckets.bucket_sizes() == (buckets.DEFAULT_BUCKET_BYTES, buckets.DEFAULT_FIRST_BUCKET_BYTES)
    buckets.set_bucket_bytes(256 * KIB)
    assert buckets.bucket_sizes() == (256 * KIB, 256 * KIB)
    buckets.set_bucket_bytes(8 * MIB, first_bucket_bytes=64 * KIB)
    assert buckets.plan([MIB] * 10) == [[9], [1, 2, 3, 4, 5, 6, 7, 8], [0]]
    buckets.set_bucket_bytes(0)
    assert buckets.plan([MIB] * 3) == [[0, 1, 2]]


def test_the_environment_sets_the_starting_value(monkeypatch):
    monkeypatch.setenv(buckets.ENV, "0")
    assert buckets.bucket_sizes() == (0, 0)


@pytest.mark.parametrize("value", [-1, 1.5, "4MB", True, None])
def test_a_bad_size_names_the_value_and_the_fix(value):
    with pytest.raises(ValueError, match=r"bucket_bytes must be a whole number of bytes >= 0; received "
                                         rf"bucket_bytes={value!r}\. For example 4194304 \(4 MiB\), or 0"):
        buckets.set_bucket_bytes(value)


def test_a_bad_first_bucket_size_is_named():
    with pytest.raises(ValueError, match=r"received first_bucket_bytes=-5"):
        buckets.set_bucket_bytes(100, first_bucket_bytes=-5)


@pytest.mark.parametrize("raw, message", [
    ("4MB", r"TFDIST_BUCKET_BYTES='4MB' is not a whole number of bytes; set it to e\.g\. 4194304 \(4 MiB buckets\) "
            r"or 0 \(one all-reduce per step\), or unset it\."),
    ("-3", r"TFDIST_BUCKET_BYTES: bucket_bytes must be a whole number of bytes >= 0; received bucket_bytes=-3"),
])
def test_a_bad_environment_value_names_the_variable(monkeypatch, raw, message):
    monkeypatch.setenv(buckets.ENV, raw)
    with pytest.raises(ValueError, match=message):
        buckets.bucket_sizes()


def test_tfdist_exports_set_bucket_bytes():
    code = "import tfdist; from tfdist import buckets; assert tfdist.set_bucket_bytes is buckets.set_bucket_bytes"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
