"""What a resume on another worker count costs: the replay that finds the records already read, against
reading the epoch once.

    python benchmarks/resume_replay.py [--records 258048] [--files 64] [--rounds 4]

Writes ``--records`` small records (an int each) into ``--files`` shards, then, in alternating rounds:

  replay    ``tfdist.data.epochs.consumed``: 2 workers read half of epoch 1, 3 workers a quarter more,
            replayed on record numbers (what a resumed fit's first step works out before it trains)
  read      one worker's whole epoch of the same files through ``tfrecord_dataset`` (seeded, shuffled,
            batches of 1536, parsed): the reading a resumed epoch does anyway

Prints every round's seconds and the ratio replay / read. The replay reads no file: its cost grows with the
records of the epoch and the runs replayed, not with the records' size, so with real records (images) the
ratio is far smaller than with these.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tfdist import data  # noqa: E402
from tfdist.data import epochs, reader  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=258048)  # 168 global batches of 1536 (2 and 3 divide it)
    parser.add_argument("--files", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    batch = 1536
    with tempfile.TemporaryDirectory() as root:
        written = data.write_tfrecords({"label": np.arange(args.records)}, root, num_shards=args.files)
        paths = sorted(reader._list_files([written.pattern], repr(written.pattern)))
        counts = [data.check_file(path).num_records for path in paths]
        files = epochs.Files(tuple(paths), tuple(counts), 5, True, True, 4096, True, False)
        steps = args.records // batch
        runs = ((2, steps // 2, batch), (3, steps * 3 // 4, batch))

        def replay() -> float:
            began = time.perf_counter()
            read = epochs.consumed(files, 1, runs)
            assert read.sum() == steps * 3 // 4 * batch
            return time.perf_counter() - began

        def read_epoch() -> float:
            dataset = data.tfrecord_dataset(written.pattern, batch_size=batch, seed=5, features=["label"])
            began = time.perf_counter()
            total = sum(int(b["label"].shape[0]) for b in dataset)
            assert total == args.records
            return time.perf_counter() - began

        print(f"{args.records} records in {args.files} files; replayed: 2 workers to step {runs[0][1]}, "
              f"3 workers to step {runs[1][1]} of {steps}")
        ratios, replays = [], []
        for number in range(args.rounds):
            order = (replay, read_epoch) if number % 2 == 0 else (read_epoch, replay)
            seconds = {step.__name__: step() for step in order}
            ratios.append(seconds["replay"] / seconds["read_epoch"])
            replays.append(seconds["replay"])
            print(f"round {number + 1}: replay {seconds['replay']:.2f} s, read the epoch {seconds['read_epoch']:.2f} s, "
                  f"ratio {ratios[-1]:.2f}")
        print(f"median ratio replay / read: {np.median(ratios):.2f}; replay "
              f"{np.median(replays) / args.records * 1e6:.1f} us per record of the epoch")


if __name__ == "__main__":
    main()
