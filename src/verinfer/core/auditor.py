"""The trusted side of an audit (`AuditCore`): its directory, the verifier engine, the replay of
claims files (each claim once) and the detector cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from verinfer.core.collect import Source, StopRule, collect
from verinfer.audit.replay import StreamRows
from verinfer.audit.score_file import VERIFIER_NUMERICS, reference_engines, score, scores_current, verifier_engine
from verinfer.claims import Claim
from verinfer.detect.base import Detector
from verinfer.detect.cache import DetectorCache
from verinfer.detect.sequential import SequentialAudit, StreamingAudit
from verinfer.io import check_writable
from verinfer.models.load import model_info
from verinfer.progress import progress_bar
from verinfer.retokenize import Retokenizer
from verinfer.scores import load_score_tables


class AuditCore:
    """One audit's trusted side: its directory, the trusted model's verifier engine (bf16, SDPA,
    `matmul`), the replay of claims files and the detector cache. gaps: replay with the signed-gap
    columns and the honest references' envelope (the glrt e-process of a seeded sequential audit);
    retokenizer: re-cut chat claims derived from text (`audit.replay.recut_claims`)."""

    def __init__(self, model_dir: str | Path, out_dir: str | Path, *, matmul: str = "native", device: str = "cpu",
                 show_progress: bool = True, retokenizer: Retokenizer | None = None, gaps: bool = False):
        check_writable(out_dir, "audit directory", directory=True)
        self.model_dir, self.out, self.show, self.gaps = Path(model_dir), Path(out_dir), show_progress, gaps
        self.out.mkdir(parents=True, exist_ok=True)
        self.info = model_info(model_dir)
        self.device, self.retok = device, retokenizer
        self.engine = verifier_engine(model_dir, VERIFIER_NUMERICS.with_(matmul=matmul), device=device)
        self.references = reference_engines(model_dir, self.engine, device) if gaps else None
        self.timings: dict = {}

    def _score(self, claims_path: Path, out: Path, **kw):
        return score(claims_path, self.model_dir, out, engine=self.engine, gaps=self.gaps, references=self.references,
                     retokenizer=self.retok, **kw)

    def score_file(self, claims_path: Path, out: Path | None = None, keep_parts: bool = False) -> Path:
        """The replay of a claims file into `out` (default: beside it, .parquet), skipped when `out`
        is newer; the parts a stop rule replayed (`stream`) are read, not replayed again.
        keep_parts: claims a resumed audit extends (a vendor's, an endpoint's)."""
        out = Path(out) if out is not None else Path(claims_path).with_suffix(".parquet")
        if not scores_current(claims_path, out):
            self._score(claims_path, out, show_progress=self.show, keep_parts=keep_parts)
        return out

    def scores(self, claims_path: Path, out: Path | None = None, keep_parts: bool = False) -> pa.Table:
        """`score_file`'s table."""
        return load_score_tables([self.score_file(claims_path, out, keep_parts)])

    def stream(self, det: Detector, alpha: float, claims_path: Path, out: Path, every: int = 1) -> StreamingAudit:
        """The anytime-valid stop rule over a claims file as it grows: each new claim replayed once,
        into the parts `score_file(claims_path, out, keep_parts=True)` reads afterwards."""
        rows = StreamRows(lambda claims: self._score(claims_path, out, show_progress=False, claims=claims,
                                                     growing=True))
        return StreamingAudit(SequentialAudit(det, alpha=alpha), rows, every=every)

    def collect(self, source: Source, out_dir: Path, label: str,
                stop: StopRule | None = None) -> tuple[list[Claim], int]:
        """(claims, requests sent) of `source` in out_dir (`collect.collect`), with a progress bar."""
        with progress_bar(label, len(source), self.show) as adv:
            return collect(source, out_dir, adv, stop)

    def detector(self, path: Path, meta: dict, fit: Callable[[], Detector]) -> Detector:
        """The detector saved at `path` when it was made for `meta`, else `fit()` saved there."""
        return DetectorCache(path).get(meta, fit)


__all__ = ["AuditCore"]
