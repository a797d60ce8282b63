"""Detectors by name: `verinfer calibrate --detector NAME`, `verinfer audit -d FILE` and the apps
make, fit and load every detector through this registry and the `Detector` protocol.

DETECTORS (registry name -> class) and FORMATS (a detector file's "format" -> class) are
`verinfer.registry.Registry`s: an unknown name raises UnknownNameError naming the choices."""

from __future__ import annotations

from pathlib import Path

from verinfer.detect.base import Detector, read_detector_json
from verinfer.detect.clipped_mean import ClippedMeanDetector
from verinfer.detect.glrt import PerturbationGLRTDetector
from verinfer.detect.greedy import GreedyDetector
from verinfer.detect.likelihood_ratio import LikelihoodRatioDetector
from verinfer.detect.unseeded import CrossEntropyExcessDetector, PITUniformityDetector
from verinfer.errors import VerinferError
from verinfer.registry import Registry

_CLASSES = (ClippedMeanDetector, GreedyDetector, PerturbationGLRTDetector, LikelihoodRatioDetector,
            CrossEntropyExcessDetector, PITUniformityDetector)
DETECTORS: Registry[type[Detector]] = Registry("detector", {c.NAME: c for c in _CLASSES})
FORMATS: Registry[type[Detector]] = Registry("detector file format", {c.FORMAT: c for c in _CLASSES})


def detector_class(name: str) -> type[Detector]:
    """The detector class registered as `name` (UnknownNameError naming the choices)."""
    return DETECTORS.get(name)


def make_detector(name: str, **options) -> Detector:
    """An unfitted detector of kind `name` with these config options (a VerinferError names an
    option the detector does not take)."""
    cls = detector_class(name)
    unknown = [k for k in options if k not in cls._config_names()]
    if unknown:
        raise VerinferError(f"the {name} detector takes no option {', '.join(unknown)}",
                            fix=f"its options: {', '.join(cls._config_names())}")
    try:
        return cls(**options)
    except ValueError as e:
        raise VerinferError(f"bad {name} detector option: {e}") from e


def load_detector(path: str | Path, *, allow_unrecorded: bool = False) -> Detector:
    """The detector in a JSON file, of the class its "format" field names (the file is read once),
    checked against its calibration record; a file without one (`detect.record.unrecorded`) is
    refused unless allow_unrecorded (`verinfer audit --allow-unrecorded-calibration`)."""
    d = read_detector_json(path)
    fmt = d.get("format") if isinstance(d, dict) else None
    if fmt not in FORMATS:
        raise VerinferError(f"not a verinfer detector file (\"format\": {fmt!r}; this verinfer reads "
                            f"{', '.join(FORMATS)})", where=str(path),
                            fix=f"fit one with `verinfer calibrate --detector NAME` ({' | '.join(DETECTORS)})")
    return FORMATS[fmt].from_json(d, where=str(path), allow_unrecorded=allow_unrecorded)
