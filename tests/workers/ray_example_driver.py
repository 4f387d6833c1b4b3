"""Ray's own TensorFlow example with one line changed, for EPOCHS epochs: ``ray_example_driver.py OUT_DIR RAY_ADDRESS EPOCHS``.

The changed line: ``os.environ["TF_USE_LEGACY_KERAS"] = "1"`` becomes ``import tfdist``.
MNIST comes from tests/workers/offline_mnist (no download). Writes OUT_DIR/result.json:
every checkpoint Ray kept (one per epoch).
"""

import difflib
import importlib
import json
import os
import pathlib
import sys

import ray
import ray.train.examples.tf.tensorflow_mnist_example as original
from ray.train import CheckpointConfig, RunConfig, ScalingConfig
from ray.train.tensorflow import TensorflowTrainer

out_dir, address, epochs = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
source = pathlib.Path(original.__file__).read_text()
changed = source.replace('os.environ["TF_USE_LEGACY_KERAS"] = "1"', "import tfdist")
diff = [line for line in difflib.unified_diff(source.splitlines(), changed.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and line[:3] not in ("+++", "---")]
assert diff == ['-os.environ["TF_USE_LEGACY_KERAS"] = "1"', "+import tfdist"], diff
module_dir = out_dir / "example"
module_dir.mkdir(parents=True, exist_ok=True)
(module_dir / "tfdist_mnist_example.py").write_text(changed)

repo = pathlib.Path(__file__).resolve().parents[2]
path = os.pathsep.join([str(module_dir), str(repo / "tests" / "workers" / "offline_mnist"), str(repo)])
ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": path, "TF_CPP_MIN_LOG_LEVEL": "2"}})
sys.path.insert(0, str(module_dir))
example = importlib.import_module("tfdist_mnist_example")
trainer = TensorflowTrainer(
    train_loop_per_worker=example.train_func,
    train_loop_config={"lr": 1e-3, "batch_size": 32, "epochs": epochs, "steps_per_epoch": 2},
    scaling_config=ScalingConfig(num_workers=2),
    run_config=RunConfig(storage_path=str(out_dir / "ray"), name="run",
                         checkpoint_config=CheckpointConfig(num_to_keep=None)))
kept = [checkpoint.path for checkpoint, _ in trainer.fit().best_checkpoints]
(out_dir / "result.json").write_text(json.dumps({"checkpoints": kept}))
