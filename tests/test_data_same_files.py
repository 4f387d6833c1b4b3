"""Workers check that they list the same files before they read (issue 43): the message, the keys, the exchange.

The exchange runs here over a store in this process (a dict), with the workers as threads; the real 2-worker job is
in tests/test_data_multi_worker.py (``reader_job``).
"""

import collections
import re
import threading
import time
import types

import pytest

from tfdist import data
from tfdist.data import agreement

TAIL = (r"\. A shared filesystem that lags \(NFS attribute caching, an object store's listing\) or files listed before "
        r"their writer finished show workers different files: build the dataset once the writer has finished "
        r"\(write_tfrecords, called on every worker, returns only then\), on a filesystem that shows every worker the "
        r"same files\.$")
SHARDS = [[f"train-{i:05d}-of-00004.tfrecord", 12] for i in range(4)]


def test_a_worker_missing_a_file_is_named_with_the_file_and_its_records():
    message = agreement.differences("shards/train-*", {0: SHARDS, 1: SHARDS[:3]})
    assert re.fullmatch(r"tfrecord_dataset\(file_pattern='shards/train-\*'\) lists other files on some workers, so "
                        r"the workers would not read every record once: worker 1 lists 3 files \(36 records\), worker "
                        r"0 lists 4 \(48 records\): worker 1 does not see 'train-00003-of-00004\.tfrecord' \(12 "
                        r"records\)" + TAIL, message)


def test_extra_files_other_counts_and_many_workers_are_named_and_capped():
    recounted = [[name, 11 if i == 1 else count] for i, (name, count) in enumerate(SHARDS)]
    many = [[f"x-{i}", 1] for i in range(6)]
    lists = {0: SHARDS, 1: SHARDS, 2: recounted + many, 3: SHARDS[:1], 4: [], 5: SHARDS[1:]}
    message = agreement.differences(["a/*", "b/*"], lists)
    assert message.startswith(
        "tfrecord_dataset(file_pattern=['a/*', 'b/*']) lists other files on some workers, so the workers would not "
        "read every record once: worker 2 lists 10 files (53 records), worker 0 lists 4 (48 records): worker 2 sees "
        "'x-0' (1 records), 'x-1' (1 records), 'x-2' (1 records) and 3 more, which worker 0 does not; worker 2 counts "
        "11 records in 'train-00001-of-00004.tfrecord', worker 0 12; worker 3 lists 1 files (12 records), worker 0 "
        "lists 4 (48 records): worker 3 does not see 'train-00001-of-00004.tfrecord' (12 records), "
        "'train-00002-of-00004.tfrecord' (12 records), 'train-00003-of-00004.tfrecord' (12 records); worker 4 lists "
        "0 files (0 records), worker 0 lists 4 (48 records): worker 4 does not see")
    assert "12 records) and 1 more; and 1 more worker(s) differ from worker 0. A shared" in message
    assert agreement.differences("p", {0: SHARDS, 1: list(SHARDS)}) is None


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


def test_each_call_has_its_own_keys_repeated_calls_and_attempts_apart(monkeypatch):
    monkeypatch.setattr(agreement, "_calls", collections.Counter())
    first, again = (agreement.call_key("tfrecord_dataset", ["shards/train-*"], {}) for _ in range(2))
    prefix = agreement.call_key("tfrecord_dataset", ["shards/train-"], {})
    other_kind = agreement.call_key("write_tfrecords", ["shards/train-*"], {})
    restarted = agreement.call_key("tfrecord_dataset", ["shards/train-*"], {"TFDIST_RESTART": "1"})
    assert re.fullmatch(r"tfdist/data/tfrecord_dataset/[0-9a-f]{16}/1", first)
    assert again == first[:-1] + "2"
    assert len({key.rsplit("/", 1)[0] for key in (first, prefix, other_kind, restarted)}) == 4
    assert restarted.endswith("/1") and prefix.endswith("/1")


def test_workers_that_reach_the_files_by_other_paths_or_orders_meet_under_one_key():
    """A mount at another place, a relative pattern against an absolute one, a list in another order: each
    worker waited out the hang timeout under a key of its own (review finding)."""
    assert agreement.pattern_key("/mnt/a/shards/data-*.tfrecord") == agreement.pattern_key("../b/data-*.tfrecord") \
        == agreement.pattern_key("data-*.tfrecord") == ["data-*.tfrecord"]
    assert agreement.pattern_key(["x/val-*", "y/train-*"]) == agreement.pattern_key(["/d/train-*", "val-*"])
    assert agreement.pattern_key("x/train-*") != agreement.pattern_key("x/val-*")
    assert agreement.relative_names(["data-*"], ["./data-0"]) == agreement.relative_names(["/m/a/data-*"], ["/m/a/data-0"])


@pytest.fixture
def store(monkeypatch):
    """tfdist.kvstore over a dict shared by this process's threads; every call gets the key "t/2" (the 2nd build of "t")."""
    values = {}

    def wait_for(key, deadline):
        while key not in values and time.monotonic() < deadline:
            time.sleep(0.01)
        return values.get(key)

    monkeypatch.setattr(agreement, "kvstore", types.SimpleNamespace(
        available=lambda: True, put=values.__setitem__, wait_for=wait_for))
    monkeypatch.setattr(agreement, "call_key", lambda kind, arguments: "t/2")
    return values


def as_workers(lists, timeout_s=30.0):
    """Runs check_same_files for each worker's list in a thread of its own; returns each worker's error (or None)."""
    errors = {}

    def worker(rank):
        try:
            agreement.check_same_files("shards/train-*", lists[rank], rank, len(lists), timeout_s=timeout_s)
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
def test_a_peer_that_never_lists_its_files_is_an_error_after_the_timeout(store):
    started = time.monotonic()
    with pytest.raises(data.DataError, match=r"^tfrecord_dataset\(file_pattern='shards/train-\*'\): worker 0 waited "
                                             r"0\.5 s for worker\(s\) \[2\] to list their files for this dataset \(build "
                                             r"2 of it in this process\), to check that every worker reads the same "
                                             r"files\. Every worker must build the same datasets with the same "
                                             r"file_pattern in the same order"):
        store["t/2/digest/1"] = agreement.hashlib.sha256(b"[]").hexdigest()
        agreement.check_same_files("shards/train-*", SHARDS, 0, 3, timeout_s=0.5)
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
