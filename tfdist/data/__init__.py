"""tfdist.data: TFRecord shards in, sharded batches out, read exactly once per epoch.

    import tfdist
    from tfdist import data

    with tfdist.scope() as strategy:
        model = build_model()
    # on every worker: the chief writes, the others wait for it
    result = data.write_tfrecords((images, labels), "shards", num_shards=16, overwrite=True)
    dataset = data.distribute(strategy, lambda ctx: data.tfrecord_dataset(
        result.pattern, batch_size=256, input_context=ctx, repeat=True,
        parse_fn=lambda b: (b["image"], b["label"])))
    model.fit(dataset, epochs=10, steps_per_epoch=result.num_records // 256)

``tfdist convert --dataset NAME --split train --out DIR`` writes a tfds dataset the same way.
"""

from tfdist.data.reader import ShardingWarning, batch_parser, distribute, per_pipeline_batch_size, tfrecord_dataset
from tfdist.data.records import INDEX_KEY, DataError, FileCheck, check_file
from tfdist.data.writer import WriteResult, write_tfrecords

__all__ = [
    "DataError",
    "FileCheck",
    "INDEX_KEY",
    "ShardingWarning",
    "WriteResult",
    "batch_parser",
    "check_file",
    "distribute",
    "per_pipeline_batch_size",
    "tfrecord_dataset",
    "write_tfrecords",
]
