"""What the workers of a job agree on about their data: store keys per call, and the files they list.

``write_tfrecords`` and ``tfrecord_dataset`` run on every worker, and their workers talk through the job's
key-value store (``tfdist.kvstore``). ``call_key`` names one call's entries by what every worker has alike: the
kind of call, the job's attempt (``TFDIST_RESTART``) and how many calls of that kind this process made before.
So the n-th call is one call on every worker (a second ``fit`` that rebuilds its dataset, or datasets whose
patterns overlap, never read another's entries), and a worker whose call differs from its peers' meets them
anyway and is told how: a key made of what is checked (the patterns, the files, the arguments) would find no
peer, and every worker would wait out the hang timeout.

``check_same_files`` (issues 43, 49): before a dataset sharded over the workers reads anything, every worker
publishes a digest of the files it lists (names relative to the patterns' directory, record counts, and the
stored checksum of each file's first record, so that files of the same names and sizes holding other records,
another split or a stale copy, differ too) and reads its peers'. Equal digests end it: one small entry per worker. When they differ, every worker publishes
its whole list, and every worker raises the same DataError, naming the workers and the files that differ. A
worker that could not list its files (none match, a damaged file) publishes that instead, and its peers stop
at once too. A peer that does not publish within the hang timeout (``TFDIST_HANG_TIMEOUT``, 600 s by default)
is an error too. The store is out of band: no collective runs while the job's strategy may run its own, and a
wait has a deadline. Worker 0 holds the store, so it raises last, once its peers have read its list (or a few
seconds).
"""

from __future__ import annotations

import base64
import collections
import hashlib
import json
import os
import time
import zlib
from typing import Mapping, Sequence

from tfdist import kvstore, watchdog
from tfdist.data.records import DataError

ENV_ATTEMPT = "TFDIST_RESTART"  # the job's attempt: tfdist run sets it (tfdist.launch.local.ENV_RESTART)
_LEAVE_LAST_S = 10.0  # how long worker 0 waits for its peers to have read its list before it raises
_SHOWN = 3  # files named per difference, and workers described, before "and N more"
_SHOWN_NAMES = 4  # a list of patterns longer than this is shown by its first and last
# This process's calls so far, per kind: the n-th call of a kind is one call on every worker.
_calls: collections.Counter = collections.Counter()

FileList = Sequence[Sequence]  # [(name, records, first record's checksum), ...] sorted by name (the checksum optional)


def call_key(kind: str, env: Mapping[str, str] | None = None) -> str:
    """The store key of this call: ``tfdist/data/KIND/<attempt>/<n>``, n counting this process's calls of
    ``kind`` (1 for the first)."""
    attempt = (os.environ if env is None else env).get(ENV_ATTEMPT, "0")
    _calls[kind] += 1
    return f"tfdist/data/{kind}/{attempt}/{_calls[kind]}"


def shown(file_pattern) -> str:
    """``file_pattern`` as messages show it: a long list by its first two and last names and its length."""
    if isinstance(file_pattern, str):
        return repr(file_pattern)
    names = [str(name) for name in file_pattern]
    if len(names) <= _SHOWN_NAMES:
        return repr(names)
    return f"[{names[0]!r}, {names[1]!r}, ..., {names[-1]!r}] ({len(names)} names)"


def relative_names(patterns: Sequence[str], paths: Sequence[str]) -> list[str]:
    """``paths`` relative to the directory the ``patterns`` share before their first glob character, so that
    workers that mount the files at other places, or list them from another working directory, compare alike."""
    dirs = [pattern[:min([pattern.find(c) for c in "*?[" if c in pattern] or [len(pattern)])].rsplit("/", 1)[0]
            if "/" in pattern else "" for pattern in patterns]
    parts = [d.split("/") for d in dirs]
    common = []
    for column in zip(*parts):
        if len(set(column)) > 1:
            break
        common.append(column[0])
    base = os.path.normpath("/".join(common)) if common else ""
    paths = [os.path.normpath(path) for path in paths]  # "./data-0" and "data-0" are one file
    return [path[len(base) + 1:] if base and path.startswith(base + "/") else path for path in paths]


def check_same_files(source: str, files: FileList | Exception, rank: int, size: int,
                     timeout_s: float | None = None, unmatched: Sequence[str] = ()) -> None:
    """Raises on every worker unless every worker of the job lists the same ``files`` for this dataset.

    Args:
        source: the dataset's ``file_pattern`` as messages show it (``shown``); it may differ per worker.
        files: this worker's ``(name, records, first_crc)`` entries, names relative to the patterns' directory,
            sorted (``first_crc`` may be left out); or the
            error that listing them raised here (published so that the peers stop at once; the caller re-raises).
        rank: this worker's rank; size: the job's worker count.
        timeout_s: how long to wait for the peers; None: the hang timeout (its default when turned off).
        unmatched: the names or patterns that matched no file here (the caller raises for them once every
            worker agrees; a worker where they differ is named).

    Raises:
        DataError: the workers' lists differ (naming the workers and files), a peer could not list its files, or
            a peer did not publish its list in time.
    """
    if size < 2 or not kvstore.available():
        return
    timeout_s = timeout_s if timeout_s is not None else (watchdog.timeout_from_env() or watchdog.DEFAULT_HANG_TIMEOUT)
    base = call_key("tfrecord_dataset")  # the n-th sharded dataset of this attempt, never what is checked
    if isinstance(files, Exception):
        kvstore.put(f"{base}/digest/{rank}", json.dumps({"source": source,
                                                         "failed": f"{type(files).__name__}: {files}"}))
        if rank == 0:  # it holds the store: its peers read the failure first (or a few seconds pass)
            _wait_for_peers(base, "digest", size, timeout_s)
        return
    files = [[name, *(int(value) for value in rest)] for name, *rest in files]
    unmatched = sorted(unmatched)
    mine = json.dumps({"source": source, "unmatched": unmatched,
                       "digest": hashlib.sha256(json.dumps([files, unmatched]).encode()).hexdigest()})
    kvstore.put(f"{base}/digest/{rank}", mine)
    digests = {peer: json.loads(value) for peer, value in _gather(base, "digest", rank, size, mine, timeout_s,
                                                                   source).items()}
    for peer, value in sorted(digests.items()):
        if "failed" in value:
            raise DataError(f"tfrecord_dataset(file_pattern={source}): worker {peer} could not list its files "
                            f"({value['failed']}), so worker {rank} stops too; worker {peer}'s output says more.")
    if len({value["digest"] for value in digests.values()}) == 1:
        return
    lists = {peer: _unpack(value) for peer, value in
             _gather(base, "files", rank, size, _published(base, rank, files), timeout_s, source).items()}
    kvstore.put(f"{base}/read/{rank}", "1")
    if rank == 0:  # it holds the store: once it exits, a peer still reading would find nothing
        _wait_for_peers(base, "read", size, timeout_s)
    sources = {peer: value["source"] for peer, value in digests.items()}
    unmatched_by_worker = {peer: value.get("unmatched", []) for peer, value in digests.items()}
    raise DataError(differences(sources, lists, unmatched_by_worker) or (
        f"tfrecord_dataset(file_pattern={source}): the workers' file lists hash differently but read the same; "
        "report this to tfdist."))


def _published(base: str, rank: int, files: FileList) -> str:
    value = _pack(files)
    kvstore.put(f"{base}/files/{rank}", value)
    return value


def _wait_for_peers(base: str, what: str, size: int, timeout_s: float) -> None:
    """Worker 0, which holds the store: until every peer wrote ``base/what/<peer>``, or a few seconds."""
    deadline = time.monotonic() + min(timeout_s, _LEAVE_LAST_S)
    for peer in range(1, size):
        kvstore.wait_for(f"{base}/{what}/{peer}", deadline)


def _gather(base: str, what: str, rank: int, size: int, mine: str, timeout_s: float, source: str) -> dict[int, str]:
    """Every worker's ``base/what/<rank>``, this worker's being ``mine``.

    Raises:
        DataError: a peer's did not appear within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    found = {rank: mine}
    for peer in range(size):
        if peer != rank:
            value = kvstore.wait_for(f"{base}/{what}/{peer}", deadline)
            if value is not None:
                found[peer] = value
    missing = [peer for peer in range(size) if peer not in found]
    if missing:
        build = base.rsplit("/", 1)[1]
        raise DataError(
            f"tfrecord_dataset(file_pattern={source}): worker {rank} waited {timeout_s:g} s for worker(s) {missing} "
            f"to list their files for this dataset (sharded dataset {build} of this process), to check that every "
            "worker reads the same files. Every worker must build the same sharded datasets in the same order (a "
            "dataset built on some workers only, or more often on some, never meets its peers); a worker busy "
            "elsewhere for that long looks the same (TFDIST_HANG_TIMEOUT sets the wait).")
    return found


def differences(sources: Mapping[int, str], lists: Mapping[int, FileList],
                unmatched: Mapping[int, Sequence[str]] | None = None) -> str | None:
    """The error message for workers whose file lists differ from worker 0's (None when none does).

    Args:
        sources: each worker's ``file_pattern``, as shown (``shown``).
        lists: each worker's ``(name, records)`` pairs.
        unmatched: each worker's names or patterns that matched no file there.
    """
    reference = {name: list(rest) for name, *rest in lists[0]}
    told, other_sources = [], []
    for rank in sorted(lists):
        theirs = {name: list(rest) for name, *rest in lists[rank]}
        unmatched = unmatched or {}
        nowhere = sorted(set(unmatched.get(rank, [])) - set(unmatched.get(0, [])))  # only on this worker
        not_on_0 = sorted(set(unmatched.get(0, [])) - set(unmatched.get(rank, [])))  # only on worker 0
        if rank == 0 or (theirs == reference and not nowhere and not not_on_0):
            continue
        common = sorted(set(theirs) & set(reference))
        missing = [f"{name!r} ({reference[name][0]} records)" for name in sorted(reference) if name not in theirs]
        extra = [f"{name!r} ({theirs[name][0]} records)" for name in sorted(theirs) if name not in reference]
        recount = [f"{theirs[name][0]} records in {name!r}, worker 0 {reference[name][0]}" for name in common
                   if theirs[name][0] != reference[name][0]]
        other = [repr(name) for name in common
                 if theirs[name][0] == reference[name][0] and theirs[name] != reference[name]]
        parts = ([f"worker {rank} does not see {_some(missing)}"] if missing else []) + (
            [f"worker {rank} sees {_some(extra)}, which worker 0 does not"] if extra else []) + (
            [f"worker {rank} counts {_some(recount)}"] if recount else []) + (
            [f"worker {rank}'s {_some(other)} begin(s) with another record than worker 0's"] if other else []) + (
            [f"on worker {rank} {_some([repr(p) for p in nowhere])} match(es) no file"] if nowhere else []) + (
            [f"on worker 0 {_some([repr(p) for p in not_on_0])} match(es) no file, on worker {rank} some"]
            if not_on_0 else [])
        elsewhere = not any(theirs[name] == reference[name] for name in common)  # maybe another dataset altogether
        given = f" (from file_pattern={sources[rank]})" if elsewhere and sources[rank] != sources[0] else ""
        other_sources += [rank] if given else []
        told.append(f"worker {rank}{given} lists {len(theirs)} files ({sum(v[0] for v in theirs.values())} records), "
                    f"worker 0 lists {len(reference)} ({sum(v[0] for v in reference.values())} records): "
                    + "; ".join(parts))
    if not told:
        return None
    more = f"; and {len(told) - _SHOWN} more worker(s) differ from worker 0" if len(told) > _SHOWN else ""
    order = (f" Worker(s) {other_sources} list no file that worker 0 lists: if that is another dataset, build the "
             "same sharded datasets in the same order on every worker." if other_sources else "")
    return (f"tfrecord_dataset(file_pattern={sources[0]}) lists other files on some workers, so the workers would "
            f"not read every record once: {'; '.join(told[:_SHOWN])}{more}.{order} A shared filesystem that lags "
            "(NFS attribute caching, an object store's listing) or files listed before their writer finished show "
            "workers different files: build the dataset once the writer has finished (write_tfrecords, called on "
            "every worker, returns only then), on a filesystem that shows every worker the same files.")


def _some(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _pack(files: FileList) -> str:
    """A file list as a store value: names repeat their prefix, so they compress well."""
    return base64.b64encode(zlib.compress(json.dumps(files).encode())).decode()


def _unpack(value: str) -> FileList:
    return json.loads(zlib.decompress(base64.b64decode(value)))
