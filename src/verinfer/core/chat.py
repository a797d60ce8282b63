"""A temperature-0 audit of chat vendors on the audit core (DiFR appendix D, the authors' `token-difr`,
Moonshot's K2 Vendor Verifier): what audit-api --chat, audit-vendors and audit-log share.

    prompts      `models.prompts.chat_messages` (the same for every vendor), or a log's own
                 conversations
    calibrate    the greedy detector (`detect.greedy`) fit on the honest configurations' greedy
                 runs of the same kind of conversations (`core.local_runs.chat_run_claims`; other
                 prompts; each configuration one group of the null), and the mismatch-rate test
                 (the same detector with floor 1: token-difr's statistic) beside it
    bands        the reference bands (`local_runs.CHAT_BANDS`) run on the vendors' conversations and
                 summarized like a vendor (`detect.summary`)
    vendor       a `sources.ChatSource` collected through the core, streamed as an anytime-valid
                 e-process over claims (requests stop once it flags), each claim replayed once
    judge        `detect.judge.judge_vendor` on the vendor's scores, and how its claims' tokens
                 were obtained (`audit.replay.resegmentation`)
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from verinfer.core.auditor import AuditCore
from verinfer.core.local_runs import CHAT_BANDS, Band, chat_run_claims
from verinfer.audit.replay import resegmentation
from verinfer.core.sources import ChatSource
from verinfer.claims import Claim
from verinfer.detect.base import Detector
from verinfer.detect.calibrate import calibrate
from verinfer.detect.judge import judge_vendor
from verinfer.detect.summary import margin_clip, summarize
from verinfer.errors import VerinferError
from verinfer.models.load import model_info
from verinfer.models.prompts import CALIB_SEED_OFFSET, chat_messages
from verinfer.providers.chat_http import ChatEndpoint
from verinfer.providers.openai_http import EndpointError
from verinfer.providers.simulated import HONEST
from verinfer.retokenize import Retokenizer
from verinfer.sampling.params import SamplingParams

TOKEN_MODES = ("derived", "returned", "auto")
BAND_ENGINES = ("verinfer", "vllm")  # who runs the reference bands: verinfer's engine, or local vLLM (DiFR's way)


@dataclass(frozen=True)
class ChatAuditConfig:
    """What an audit of chat endpoints asks (the same for every vendor)."""

    model_dir: Path                   # the trusted local copy of the claimed model
    out_dir: Path
    n: int = 64                       # prompts: the most requests per vendor
    max_tokens: int = 64
    seed: int = 0
    system_prompt: str | None = None  # the auditor's system message (None: the endpoint's template default)
    tokens: str = "derived"           # claim ids: derived from the text | returned by the endpoint | auto
    sequential: bool = True           # stop a vendor's requests as soon as it is flagged
    target_fpr: float = 0.01
    honest: tuple[str, ...] = tuple(HONEST)
    calib_n: int = 64                 # prompts per honest calibration run and per band
    bands: tuple[str, ...] = tuple(CHAT_BANDS)
    band_engine: str = "verinfer"     # "vllm": the bands run on local vLLM (the [vllm] extra), as the DiFR authors did
    device: str = "cpu"
    matmul: str = "native"

    def __post_init__(self):
        if self.n < 1 or self.max_tokens < 1 or self.calib_n < 1:
            raise VerinferError(f"need n, max_tokens and calib_n >= 1, got {self.n}, {self.max_tokens}, "
                                f"{self.calib_n}")
        if self.tokens not in TOKEN_MODES:
            raise VerinferError(f"tokens must be one of {', '.join(TOKEN_MODES)}, got {self.tokens!r}")
        if self.band_engine not in BAND_ENGINES:
            raise VerinferError(f"band_engine must be one of {', '.join(BAND_ENGINES)}, got {self.band_engine!r}")
        for name in self.honest:
            HONEST.get(name)
        for name in self.bands:
            CHAT_BANDS.get(name)

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(0.0, -1, 1.0, 0.0, None, self.max_tokens, "vllm-cpu")

    def settings(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


@dataclass
class VendorResult:
    """One vendor's row of the dashboard (`vendors.json`); the fields after `served_model` are
    `detect.judge.judge_vendor`'s."""

    name: str
    base_url: str
    served_model: str
    verdict: dict | None = None
    nearest_band: str | None = None
    exact_match: float | None = None
    margin: dict | None = None
    cross_entropy: dict | None = None
    mismatch: dict | None = None
    n_tokens: int = 0
    n_requests: int = 0
    tokens_to_decide: int | None = None
    requests_to_decide: int | None = None
    mismatch_test: dict | None = None  # the calibrated mismatch-rate test on the same claims (sequential + fixed)
    retokenized: float | None = None
    resegmented: float | None = None
    drift: float | None = None
    error: str | None = None

    @property
    def flagged(self) -> bool | None:
        return None if self.verdict is None else bool(self.verdict["flagged"])


def collect_manifest(endpoint: ChatEndpoint, cfg: ChatAuditConfig, conversations: list[list[dict]]) -> dict:
    """What identifies a vendor's collection: its name, served model and request fields (its URL and
    key may change between runs), and what was asked."""
    h = hashlib.sha256(json.dumps(conversations).encode()).hexdigest()[:16]
    return {"name": endpoint.name, "model": endpoint.model, "extra": endpoint.extra, "max_tokens": cfg.max_tokens,
            "temperature": 0.0, "tokens": cfg.tokens, "conversations_sha256": h}


def chat_source(endpoint: ChatEndpoint, cfg: ChatAuditConfig, conversations: list[list[dict]],
                retok: Retokenizer, info=None) -> ChatSource:
    """A vendor's requests as a collection source (greedy, cfg.max_tokens, cfg.tokens); info: the
    trusted model's `model_info` when the caller has it (reading it hashes the weights)."""
    info = info or model_info(cfg.model_dir)
    return ChatSource(endpoint, conversations, cfg.params, cfg.tokens, retok, info.name, info.vocab_size,
                      collect_manifest(endpoint, cfg, conversations))


class ChatAudit:
    """An audit's shared parts on one `AuditCore`: the tokenizer, the calibrated detectors and the
    reference bands (computed once, cached in out_dir), then any number of vendors."""

    def __init__(self, cfg: ChatAuditConfig, show_progress: bool = True,
                 conversations: list[list[dict]] | None = None, max_tokens: list[int] | None = None):
        self.cfg = cfg
        self.core = AuditCore(cfg.model_dir, cfg.out_dir, matmul=cfg.matmul, device=cfg.device,
                              show_progress=show_progress)
        self.retok = self.core.retok = Retokenizer.for_model(cfg.model_dir)
        self.out, self.info, self.timings = self.core.out, self.core.info, self.core.timings
        self.conversations = conversations or chat_messages(cfg.n, cfg.seed, cfg.system_prompt)
        self.max_tokens = max_tokens  # per conversation (a log's), else cfg.max_tokens
        self.calibration = None       # (conversations, max_tokens) to calibrate on; None: fresh prompts

    def _local(self, names: dict[str, Band], sub: str, conv: list[list[dict]],
               max_tokens: list[int] | None = None, engine: str = "verinfer") -> dict[str, pa.Table]:
        cfg = self.cfg
        return {name: self.core.scores(chat_run_claims(band, name, cfg.model_dir, cfg.params, conv, self.retok,
                                                       self.out / sub, self.info.name, max_tokens=max_tokens,
                                                       engine=engine, device=cfg.device, show_progress=self.core.show))
                for name, band in names.items()}

    def detector(self) -> Detector:
        """The greedy detector fit on the honest configurations' greedy chat runs (cached in
        out_dir/detector.json with the settings it was made for)."""
        return self._fit("detector.json", "greedy", {})

    def mismatch_detector(self) -> Detector:
        """The calibrated mismatch-rate test (the greedy detector with floor 1: every mismatch counts 1,
        token-difr's statistic with verinfer's pass line and the same null), fit on the same honest
        runs; out_dir/mismatch_detector.json."""
        return self._fit("mismatch_detector.json", "greedy", {"floor": 1.0})

    def _fit(self, name: str, kind: str, options: dict) -> Detector:
        cfg = self.cfg
        meta = {"model_weights_sha256": self.info.weights_sha256, "max_tokens": cfg.max_tokens,
                "honest": list(cfg.honest), "calib_n": cfg.calib_n, "seed": cfg.seed,
                "system_prompt": cfg.system_prompt, "target_fpr": cfg.target_fpr, "matmul": cfg.matmul,
                "detector": kind, "options": options}
        if self.calibration is not None:
            meta["calibration_sha256"] = hashlib.sha256(json.dumps(self.calibration).encode()).hexdigest()[:16]

        def fit() -> Detector:
            t0 = time.perf_counter()
            conv, lengths = self.calibration or (chat_messages(cfg.calib_n, cfg.seed + CALIB_SEED_OFFSET,
                                                               cfg.system_prompt), None)
            tables = self._local({h: Band.honest(h) for h in cfg.honest}, "calibration", conv, lengths)
            det = calibrate(pa.concat_tables(tables.values()), list(cfg.honest), detector=kind,
                            target_fpr=cfg.target_fpr, seed=cfg.seed, **options)
            self.timings[f"calibration_{Path(name).stem}_s"] = time.perf_counter() - t0  # detector, mismatch_detector
            return det

        return self.core.detector(self.out / name, meta, fit)

    def bands(self, det: Detector) -> dict:
        """Each band run on the vendors' own conversations (a score's level depends on the prompts)."""
        t0 = time.perf_counter()
        sub = "bands" if self.cfg.band_engine == "verinfer" else f"bands-{self.cfg.band_engine}"
        tables = self._local({b: CHAT_BANDS.get(b) for b in self.cfg.bands}, sub, self.conversations,
                             self.max_tokens, self.cfg.band_engine)
        out = {name: {**summarize(t, margin_clip(det), seed=self.cfg.seed),
                      "description": CHAT_BANDS.get(name).description} for name, t in tables.items()}
        self.timings["bands_s"] = time.perf_counter() - t0
        return out

    def vendor(self, endpoint: ChatEndpoint, det: Detector, bands: dict) -> VendorResult:
        """Collect (resuming), replay and judge one vendor; an endpoint error is the row's `error`."""
        row = VendorResult(endpoint.name, endpoint.base_url, endpoint.model)
        out = self.out / "vendors" / endpoint.name
        stop = (self.core.stream(det, self.cfg.target_fpr, out / "claims.jsonl", out / "scores.parquet",
                                 every=endpoint.concurrency) if self.cfg.sequential else None)
        try:
            claims, sent = self.core.collect(chat_source(endpoint, self.cfg, self.conversations, self.retok,
                                                         self.info), out,
                                             f"{endpoint.name}: requests", stop)
        except (EndpointError, VerinferError) as e:
            row.error = str(e)
            return row
        return self.judge(row, claims, sent, out, det, bands,
                          stopped_early=self.cfg.sequential and sent < len(self.conversations))

    def judge(self, row: VendorResult, claims: list[Claim], sent: int, out: Path, det: Detector,
              bands: dict, stopped_early: bool = False) -> VendorResult:
        """Replay a vendor's claims (out/claims.jsonl, the stop rule's parts read, not replayed
        again) and fill its row (`detect.judge.judge_vendor`) and how its claims' tokens were
        obtained. stopped_early: its requests stopped before the last conversation."""
        table = self.core.scores(out / "claims.jsonl", out / "scores.parquet", keep_parts=True)
        judged = judge_vendor(table, det, self.mismatch_detector(), alpha=self.cfg.target_fpr, bands=bands,
                              name=row.name, seed=self.cfg.seed, stopped_early=stopped_early)
        for key, value in judged.items():
            setattr(row, key, value)
        row.n_requests = int(sent)
        row.retokenized = float(np.mean([c.derived for c in claims]))
        row.resegmented, row.drift = resegmentation(claims, table)
        return row


__all__ = ["BAND_ENGINES", "ChatAudit", "ChatAuditConfig", "TOKEN_MODES", "VendorResult", "chat_source",
           "collect_manifest"]
