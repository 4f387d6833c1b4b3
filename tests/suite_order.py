"""The order pytest-xdist hands out the suite's modules (tests/conftest.py loads this plugin): the longest first.

Under ``--dist loadfile`` (tests/run.sh) each worker takes whole modules in the queue's order as it frees up, and a
long module that came last would run alone at the end while the other workers sit idle. pytest-xdist (3.5 and
later) reorders that queue by each module's number of tests, which put the Keras gate (a few tests, the longest
module) near the end; 3.8 added the option to turn that off (setup.cfg's test extras ask for 3.8 or later). This
plugin turns it off and sorts the modules of ``SLOW_MODULES`` first.
"""

from __future__ import annotations

import os

# Longest first, from the suite's --durations on 3 workers, 2026-11-29.
SLOW_MODULES = tuple(f"test_{name}" for name in (
    "keras_gate", "preemption", "loss_matrix", "sharded_state_multi_worker", "uneven_batches", "sharded_state",
    "data_resume", "watchdog", "powersgd", "ray", "checkpoint_multi_worker", "elastic_netns", "elastic", "equivalence",
    "horovod_examples", "checkpoint_manager", "faults", "buckets_multi_worker", "model_files", "mpi"))


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's reorder by test count, on by default
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    def rank(item):
        module = item.module.__name__.rpartition(".")[2]
        return SLOW_MODULES.index(module) if module in SLOW_MODULES else len(SLOW_MODULES)

    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects the same order
        items.sort(key=rank)  # stable: each module's tests stay together, in their order
