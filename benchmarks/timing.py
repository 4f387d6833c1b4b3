"""The measured result every benchmark here reports: a frozen record, printed separately."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Timing:
    """``images`` processed in ``seconds`` by the run called ``name``."""

    name: str
    images: int
    seconds: float

    @property
    def images_per_sec(self) -> float:
        return self.images / self.seconds
