"""The benchmark's models, each ending in a float32 classifier (safe under mixed precision)."""

from __future__ import annotations

import keras


def build_model(name: str, image_size: int, num_classes: int) -> keras.Model:
    """A compiled-ready model for ``image_size`` x ``image_size`` RGB inputs scaled to [0, 1]."""
    inputs = keras.Input((image_size, image_size, 3))
    if name == "small_cnn":
        x = inputs
        for filters in (32, 64, 64):
            x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
            x = keras.layers.MaxPooling2D()(x)
        features = keras.layers.GlobalAveragePooling2D()(x)
    else:
        application = {"mobilenet_v2": keras.applications.MobileNetV2,
                       "resnet50": keras.applications.ResNet50}[name]
        base = application(input_shape=(image_size, image_size, 3), include_top=False, weights=None, pooling="avg")
        features = base(inputs)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32")(features)
    return keras.Model(inputs, outputs, name=name)
