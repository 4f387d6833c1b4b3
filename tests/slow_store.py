"""A stand-in for TensorFlow's coordination store that takes 5 ms to answer, as the real one does now and then on
a loaded machine: a read given less time finds nothing, even a key that is there (``monkeypatch.setattr(kvstore,
"_context", lambda: SlowStore(values))``)."""

import time


class SlowStore:
    def __init__(self, values: dict[str, str]):
        self.values = values

    def get_config_key_value(self, key, timeout_ms):
        if key not in self.values or timeout_ms < 5:
            time.sleep(timeout_ms / 1000)
            raise RuntimeError("DEADLINE_EXCEEDED")
        time.sleep(0.005)
        return self.values[key]

    def set_config_key_value(self, key, value):
        self.values[key] = value

    def delete_config_key_value(self, key):
        self.values.pop(key, None)
