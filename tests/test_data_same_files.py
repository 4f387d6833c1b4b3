"""Workers check that they list the same files before they read (issues 43, 49): the message, the keys, the exchange.

The exchange runs here over a store in this process (a dict), with the workers as threads; real 2-worker jobs are
at the end (``file_forms_job.py``) and in tests/test_data_multi_worker.py (``reader_job``).
"""

import collections
import re
import shutil
import threading
import time
import types

import numpy as np
import pytest

from tests.jobs import run_job
from tfdist import data
from tfdist.data import agreement

TAIL = (r"\. A shared filesystem that lags \(NFS attribute caching, an object store's listing\) or files listed before "
        r"their writer finished show workers different files: build the dataset once the writer has finished "
        r"\(write_tfrecords, called on every worker, returns only then\), on a filesystem that shows every worker the "
        r"same files\.$")
SHARDS = [[f"train-{i:05d}-of-00004.tfrecord", 12] for i in range(4)]


def test_a_worker_missing_a_file_is_named_with_the_file_and_its_records():
    message = agreement.differences({0: "'shards/train-*'", 1: "'shards/train-*'"}, {0: SHARDS, 1: SHARDS[:3]})
    assert re.fullmatch(r"tfrecord_dataset\(file_pattern='shards/train-\*'\) lists other files on some workers, so "
                        r"the workers would not read every record once: worker 1 lists 3 files \(36 records\), worker "
                        r"0 lists 4 \(48 records\): worker 1 does not see 'train-00003-of-00004\.tfrecord' \(12 "
                        r"records\)" + TAIL, message)


def test_extra_files_other_counts_and_many_workers_are_named_and_capped():
    recounted = [[name, 11 if i == 1 else count] for i, (name, count) in enumerate(SHARDS)]
    many = [[f"x-{i}", 1] for i in range(6)]
    lists = {0: SHARDS, 1: SHARDS, 2: recounted + many, 3: SHARDS[:1], 4: [], 5: SHARDS[1:]}
    message = agreement.differences({rank: "['a/*', 'b/*']" for rank in lists}, lists)
    assert message.startswith(
        "tfrecord_dataset(file_pattern=['a/*', 'b/*']) lists other files on some workers, so the workers would not "
        "read every record once: worker 2 lists 10 files (53 records), worker 0 lists 4 (48 records): worker 2 sees "
        "'x-0' (1 records), 'x-1' (1 records), 'x-2' (1 records) and 3 more, which worker 0 does not; worker 2 counts "
        "11 records in 'train-00001-of-00004.tfrecord', worker 0 12; worker 3 lists 1 files (12 records), worker 0 "
        "lists 4 (48 records): worker 3 does not see 'train-00001-of-00004.tfrecord' (12 records), "
        "'train-00002-of-00004.tfrecord' (12 records), 'train-00003-of-00004.tfrecord' (12 records); worker 4 lists "
        "0 files (0 records), worker 0 lists 4 (48 records): worker 4 does not see")
    assert "12 records) and 1 more; and 1 more worker(s) differ from worker 0. A shared" in message
    assert agreement.differences({0: "'p'", 1: "'q'"}, {0: SHARDS, 1: list(SHARDS)}) is None


def test_a_worker_that_lists_nothing_alike_is_told_it_may_build_another_dataset():
    """Its n-th sharded dataset is not worker 0's n-th: the datasets are built in another order (or on some
    workers only)."""
    message = agreement.differences({0: "'train-*'", 1: "'val-*'"}, {0: SHARDS, 1: [["val-0", 5]]})
    assert ("worker 1 (from file_pattern='val-*') lists 1 files (5 records), worker 0 lists 4 (48 records): worker 1 "
            "does not see") in message
    assert (". Worker(s) [1] list no file that worker 0 lists: if that is another dataset, build the same sharded "
            "datasets in the same order on every worker. A shared filesystem") in message


def test_long_lists_are_shown_by_their_ends_and_length():
    names = [f"d/t-{i}" for i in range(1024)]
    assert agreement.shown(names) == "['d/t-0', 'd/t-1', ..., 'd/t-1023'] (1024 names)"
    assert agreement.shown(names[:4]) == repr(names[:4]) and agreement.shown("d/t-*") == "'d/t-*'"


@pytest.mark.parametrize("patterns,paths,names", [
    (["shards/train-*"], ["shards/train-0", "shards/train-1"], ["train-0", "train-1"]),
    (["/data/x/*/t-*"], ["/data/x/a/t-0"], ["a/t-0"]),
    (["gs://b/x/t-*", "gs://b/y/v-*"], ["gs://b/x/t-0", "gs://b/y/v-0"], ["x/t-0", "y/v-0"]),
    (["t-*.tfrecord"], ["t-0.tfrecord"], ["t-0.tfrecord"]),
    (["/a/t-*", "rel/t-*"], ["/a/t-0", "rel/t-0"], ["/a/t-0", "rel/t-0"]),
    (["/d/one.tfrecord"], ["/d/one.tfrecord"], ["one.tfrecord"]),
])
def test_names_are_relative_to_the_directory_the_patterns_share(patterns, paths, names):
    """So that a worker that mounts the files elsewhere, or lists from another working directory, compares alike."""
    assert agreement.relative_names(patterns, paths) == names


def test_each_call_is_keyed_by_its_number_of_its_kind_and_the_attempt_never_by_what_it_checks(monkeypatch):
    """Issue 49: keys made of the patterns met no peer when the patterns themselves differed."""
    monkeypatch.setattr(agreement, "_calls", collections.Counter())
    first, again = (agreement.call_key("tfrecord_dataset", {}) for _ in range(2))
    other_kind = agreement.call_key("write_tfrecords", {})
    restarted = agreement.call_key("tfrecord_dataset", {"TFDIST_RESTART": "1"})
    assert (first, again, other_kind, restarted) == (
        "tfdist/data/tfrecord_dataset/0/1", "tfdist/data/tfrecord_dataset/0/2", "tfdist/data/write_tfrecords/0/1",
        "tfdist/data/tfrecord_dataset/1/3")


def test_names_of_workers_that_reach_the_files_by_other_paths_compare_alike():
    assert agreement.relative_names(["data-*"], ["./data-0"]) == agreement.relative_names(["/m/a/data-*"], ["/m/a/data-0"])
    assert agreement.relative_names(["/m/a/t-0", "/m/a/t-1"], ["/m/a/t-0", "/m/a/t-1"]) == \
        agreement.relative_names(["../b/t-0", "../b/t-1"], ["../b/t-0", "../b/t-1"]) == ["t-0", "t-1"]


@pytest.fixture
def kv(monkeypatch):
    """tfdist.kvstore over a dict shared by this process's threads."""
    values = {}

    def wait_for(key, deadline):
        while key not in values and time.monotonic() < deadline:
            time.sleep(0.01)
        return values.get(key)

    monkeypatch.setattr(agreement, "kvstore", types.SimpleNamespace(
        available=lambda: True, put=values.__setitem__, wait_for=wait_for))
    return values


@pytest.fixture
def store(kv, monkeypatch):
    """``kv``; every call gets the key "t/2" (the 2nd sharded dataset)."""
    monkeypatch.setattr(agreement, "call_key", lambda kind: "t/2")
    return kv


class PerThread:
    """``agreement._calls`` as each thread (a worker here) would count its own calls."""

    def __init__(self):
        self.local = threading.local()

    def counter(self):
        self.local.__dict__.setdefault("calls", collections.Counter())
        return self.local.calls

    def __getitem__(self, kind):
        return self.counter()[kind]

    def __setitem__(self, kind, value):
        self.counter()[kind] = value


def as_workers(lists, timeout_s=30.0, sources=None, builds=1):
    """Runs check_same_files for each worker's list in a thread of its own (``builds`` times, the last with
    ``lists``, the ones before with a list every worker has); returns each worker's last error (or None)."""
    errors = {}

    def worker(rank):
        try:
            for _ in range(builds - 1):
                agreement.check_same_files("'x'", SHARDS, rank, len(lists), timeout_s=timeout_s)
            source = sources[rank] if sources else "'shards/train-*'"
            agreement.check_same_files(source, lists[rank], rank, len(lists), timeout_s=timeout_s)
            errors[rank] = None
        except data.DataError as error:
            errors[rank] = str(error)
    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(len(lists))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return errors


@pytest.mark.timeout(60)
def test_workers_that_agree_exchange_one_digest_each(store):
    assert as_workers([SHARDS, list(SHARDS), list(SHARDS)]) == {0: None, 1: None, 2: None}
    assert sorted(store) == ["t/2/digest/0", "t/2/digest/1", "t/2/digest/2"]


@pytest.mark.timeout(60)
def test_every_worker_raises_the_same_message_and_worker_0_after_its_peers_read_its_list(store):
    errors = as_workers([SHARDS, SHARDS[:3]])
    assert errors[0] == errors[1] and "worker 1 does not see 'train-00003-of-00004.tfrecord'" in errors[0]
    assert sorted(store) == ["t/2/digest/0", "t/2/digest/1", "t/2/files/0", "t/2/files/1", "t/2/read/0", "t/2/read/1"]


@pytest.mark.timeout(60)
def test_workers_whose_lists_and_patterns_differ_meet_under_the_number_of_their_build(kv, monkeypatch):
    """Issue 49: each worker passes the list it globbed, one shorter on worker 1; keyed by the patterns, each
    waited under a key of its own. Keyed by the build's number (the 3rd here), they meet and name the file."""
    monkeypatch.setattr(agreement, "_calls", PerThread())
    names = [name for name, _ in SHARDS]
    started = time.monotonic()
    errors = as_workers([SHARDS, SHARDS[:3]], timeout_s=30, sources=[agreement.shown(names),
                                                                     agreement.shown(names[:3])], builds=3)
    assert time.monotonic() - started < 15
    assert errors[0] == errors[1] and errors[0].startswith(
        f"tfrecord_dataset(file_pattern={names!r}) lists other files on some workers, so the workers would not read "
        "every record once: worker 1 lists 3 files (36 records), worker 0 lists 4 (48 records): worker 1 does not see "
        "'train-00003-of-00004.tfrecord' (12 records). A shared filesystem")
    assert sorted(key for key in kv if "/files/" in key) == ["tfdist/data/tfrecord_dataset/0/3/files/0",
                                                             "tfdist/data/tfrecord_dataset/0/3/files/1"]


@pytest.mark.timeout(60)
def test_a_peer_that_never_lists_its_files_is_an_error_after_the_timeout(store):
    started = time.monotonic()
    with pytest.raises(data.DataError, match=r"^tfrecord_dataset\(file_pattern='shards/train-\*'\): worker 0 waited "
                                             r"0\.5 s for worker\(s\) \[2\] to list their files for this dataset "
                                             r"\(sharded dataset 2 of this process\), to check that every worker reads "
                                             r"the same files\. Every worker must build the same sharded datasets in the "
                                             r"same order"):
        store["t/2/digest/1"] = '{"source": "x", "digest": "0"}'
        agreement.check_same_files("'shards/train-*'", SHARDS, 0, 3, timeout_s=0.5)
    assert time.monotonic() - started < 5


@pytest.mark.timeout(60)
def test_a_worker_that_cannot_list_its_files_stops_its_peers_at_once(store):
    """Its own error it raises itself (tfrecord_dataset re-raises it); the others name it instead of waiting."""
    started = time.monotonic()
    errors = as_workers([SHARDS, FileNotFoundError("file_pattern='shards/train-*' matches no file."), SHARDS])
    assert errors[1] is None
    for rank in (0, 2):
        assert errors[rank] == (f"tfrecord_dataset(file_pattern='shards/train-*'): worker 1 could not list its files "
                                f"(FileNotFoundError: file_pattern='shards/train-*' matches no file.), so worker {rank} "
                                "stops too; worker 1's output says more.")
    assert time.monotonic() - started < 5


@pytest.fixture(scope="module")
def lagging_work(tmp_path_factory):
    """A directory per worker: worker 0 sees 4 shards of 8 records, worker 1 the first 3 (a listing that lags)."""
    work = tmp_path_factory.mktemp("forms_work")
    shards = data.write_tfrecords({"label": np.arange(32)}, str(work / "0" / "shards"), num_shards=4, prefix="train")
    (work / "1" / "shards").mkdir(parents=True)
    for path in shards.paths[:3]:
        shutil.copy(path, work / "1" / "shards")
    return work


MISSING = "worker 1 does not see 'train-00003-of-00004.tfrecord' (8 records)"
EMPTY = ("worker 1 (from file_pattern=[]) lists 0 files (0 records), worker 0 lists 4 (32 records): worker 1 does not see "
         "'train-00000-of-00004.tfrecord' (8 records)")


def test_a_worker_whose_file_list_is_one_shorter_stops_the_job_in_seconds_naming_the_worker_and_the_file(
        lagging_work, tmp_path):
    """Issue 49: each worker passes the list it globbed; the lists differ, so a check keyed by them never met and
    the job was killed at its --timeout with no message."""
    result = run_job("file_forms_job.py", tmp_path, str(lagging_work), "list", timeout=200)
    seconds = float(re.search(r"2 worker\(s\), exit codes \[\w+, \w+\], ([\d.]+)s", result.output).group(1))
    assert result.returncode != 0 and seconds < 60, result.output[-3000:]
    for rank in (0, 1):
        assert re.search(rf"\[{rank}\] tfdist\.errors\.DataError: tfrecord_dataset\(file_pattern=\['shards/train-"
                         rf"00000-of-00004\.tfrecord', .*\]\) lists other files on some workers, so the workers would "
                         rf"not read every record once: worker 1 lists 3 files \(24 records\), worker 0 lists 4 \(32 "
                         rf"records\): {re.escape(MISSING)}\. A shared filesystem", result.output), \
            result.output[-3000:]
    assert "began its first step" not in result.output


def test_every_form_of_file_list_that_differs_is_named_in_seconds_and_the_next_dataset_meets_its_peers(
        lagging_work, tmp_path):
    """A pattern, a list of names, a list of patterns that differs per worker, a tf.data.Dataset.list_files, a list
    empty on worker 1 (it raised there before the check, and worker 0 waited out the hang timeout): every
    worker raises the same message within seconds; then a dataset both list alike reads every record once."""
    result = run_job("file_forms_job.py", tmp_path, str(lagging_work), "forms", timeout=200).check()
    shown = {"pattern": "'shards/train-*.tfrecord'",
             "list": "['shards/train-00000-of-00004.tfrecord', 'shards/train-00001-of-00004.tfrecord', "
                     "'shards/train-00002-of-00004.tfrecord', 'shards/train-00003-of-00004.tfrecord']",
             "patterns": "['shards/train-0000[0-1]-*', 'shards/train-0000[2-3]-*']"}
    for form in ("pattern", "list", "patterns", "list_files", "empty"):
        messages = [result.results[rank][form][0] for rank in (0, 1)]
        assert messages[0] == messages[1], (form, messages)
        assert (MISSING if form != "empty" else EMPTY) in messages[0] and messages[0].startswith(
            f"tfrecord_dataset(file_pattern={shown.get(form, shown['list'])}) lists other files"), (form, messages[0])
        assert max(result.results[rank][form][1] for rank in (0, 1)) < 20, form
    assert sorted(result.results[0]["after"] + result.results[1]["after"]) == [i for i in range(32) if i % 4 != 3]


@pytest.mark.timeout(60)
def test_files_of_the_same_names_and_counts_holding_other_records_differ(tmp_path, kv, monkeypatch):
    """Worker 0 builds train then val, worker 1 val then train: both splits written by write_tfrecords with the same
    prefix, shard count and record counts. Names and counts alike, the n-th builds passed the check and the workers
    would have read different data; the first record's stored checksum tells the files apart."""
    monkeypatch.setattr(agreement, "_calls", PerThread())
    listed = {}
    for split, first in (("train", 0), ("val", 100)):
        written = data.write_tfrecords({"label": np.arange(first, first + 8)}, str(tmp_path / split), num_shards=2)
        checks = [data.check_file(path) for path in written.paths]
        listed[split] = sorted(zip(agreement.relative_names([written.pattern], written.paths),
                                   [c.num_records for c in checks], [c.first_crc for c in checks]))
    assert [name for name, *_ in listed["train"]] == [name for name, *_ in listed["val"]]
    errors = as_workers([listed["train"], listed["val"]], sources=["'train/data-*'", "'val/data-*'"])
    assert errors[0] == errors[1] and (
        "worker 1 (from file_pattern='val/data-*') lists 2 files (8 records), worker 0 lists 2 (8 records): "
        "worker 1's 'data-00000-of-00002.tfrecord', 'data-00001-of-00002.tfrecord' begin(s) with another record than "
        "worker 0's. Worker(s) [1] list no file that worker 0 lists: if that is another dataset") in errors[0], errors[0]


@pytest.mark.timeout(60)
def test_a_name_that_matches_no_file_on_one_worker_only_is_named_on_every_worker(store):
    """The other names give every worker the same files, so the lists agree; the name that matches nothing on
    worker 1 only raised there alone, after the check, and worker 0 went on to train without it."""
    errors = {}

    def worker(rank):
        try:
            agreement.check_same_files("['shards/train-*', 'extra/*']", SHARDS, rank, 2, timeout_s=30,
                                       unmatched=["extra/*"] if rank == 1 else [])
            errors[rank] = None
        except data.DataError as error:
            errors[rank] = str(error)
    threads = [threading.Thread(target=worker, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors[0] == errors[1] and "on worker 1 'extra/*' match(es) no file" in errors[0], errors
