"""Offline MNIST for Ray's example: ``keras.datasets.mnist.load_data`` returns generated digits (no download).

On a Ray worker's PYTHONPATH, Python runs this at start-up; it patches the Keras module
when it is first imported, and imports nothing heavy itself.
"""

import importlib.abc
import importlib.util
import sys

_MODULE = "keras.src.datasets.mnist"


def _load_data(path="mnist.npz"):
    import numpy as np

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 2048)
    templates = rng.integers(0, 256, (10, 28, 28))
    images = np.clip(templates[labels] + rng.integers(-40, 40, (2048, 28, 28)), 0, 255).astype(np.uint8)
    return (images, labels.astype(np.uint8)), (images[:256], labels[:256].astype(np.uint8))


class _PatchMnist(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.load_data = _load_data

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchMnist())
