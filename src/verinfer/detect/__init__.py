"""Detectors: one protocol (`base.Detector`: fit / score / verdict / to_json / save / load) and a
registry by name (`registry`); metrics of detection power (`metrics`)."""

from verinfer.detect.base import Detector
from verinfer.detect.registry import DETECTORS, detector_class, load_detector, make_detector

__all__ = ["DETECTORS", "Detector", "detector_class", "load_detector", "make_detector"]
