"""A calibrated detector saved with what it was made for: `<detector>.json` and its `.meta.json`
sidecar (the settings of the calibration: trusted model weights, sampling, honest configurations,
detector and options). An audit reuses a saved detector only when the sidecar equals the settings it
would calibrate with; the audit decides what a mismatch means (audit-api's user-given --detector
path: an error before the first request; a chat audit's own directory: calibrate again). A saved
detector is loaded as `verinfer audit` loads one: checked against its calibration record.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from verinfer.detect.base import Detector
from verinfer.detect.record import UnrecordedCalibration
from verinfer.detect.registry import load_detector
from verinfer.io import atomic_write_json, side_path


class DetectorCache:
    """The detector file `path` and its `.meta.json` sidecar."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta_path = side_path(self.path, ".meta.json")

    def saved_meta(self) -> dict | None:
        """The sidecar of the saved detector (None: no detector, or one saved without a sidecar)."""
        if not (self.path.is_file() and self.meta_path.is_file()):
            return None
        try:
            return json.loads(self.meta_path.read_text())
        except json.JSONDecodeError:
            return None

    def load(self) -> Detector:
        return load_detector(self.path)

    def save(self, det: Detector, meta: dict) -> Detector:
        """det saved with its sidecar (the detector first: a sidecar always names a saved detector)."""
        det.save(self.path)
        atomic_write_json(self.meta_path, meta)
        return det

    def get(self, meta: dict, fit: Callable[[], Detector]) -> Detector:
        """The saved detector when it was made for `meta`, else `fit()` saved with `meta`; a saved
        detector without its calibration record (an older verinfer's) is fit again like one made
        for other settings."""
        if self.saved_meta() == meta:
            try:
                return self.load()
            except UnrecordedCalibration:
                pass
        return self.save(fit(), meta)
