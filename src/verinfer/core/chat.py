"""An audit of chat vendors on the audit core (DiFR appendix D, the authors' `token-difr`, Moonshot's
K2 Vendor Verifier): what audit-api --chat, audit-vendors and audit-log share. Each vendor is judged
in one mode (`ChatSampling`): `greedy` (temperature 0), `seeded` (temperature > 0, a per-request
seed, the noise backend the vendor samples with: Token-DiFR on the seeded sample) or `unseeded`
(sampled, and the vendor ignores seeds or no known sampler reproduces them: its claims are written
without seed or noise and judged from the reference's distribution alone, `detect.unseeded`).

    mode         temperature 0: greedy; else `--mode seeded` (the declared noise backend) or `auto`
                 (`probe_vendor`: the first conversation sent twice with one seed and once with
                 another, `core.completions.seed_probe`, the backends of `probe_candidates` tried on
                 the reply's re-cut tokens): seeds honoured -> seeded with the backend that
                 reproduces the reply; the reply unchanged by the seed (fixed noise) -> seeded with
                 the first of `completions.FIXED_SEEDS` a backend reproduces it at, on every
                 claim, else not judged (`FIXED_NOISE_NOTE`); else unseeded

    prompts      `models.prompts.chat_messages` (the same for every vendor; conversation i carries
                 seed `request_seed(seed, i)` when sampled), or a log's own conversations
    calibrate    the mismatch-and-margin detector (`detect.greedy`: at temperature > 0 the margin
                 and the exact match are the post-Gumbel ones of the seeded replay) fit on the
                 honest configurations' runs of the same kind of conversations at the vendor's
                 sampling (`core.local_runs.chat_run_claims`; other prompts and seeds; each
                 configuration one group of the null; one detector per sampling, `ChatSampling.key`),
                 and the mismatch-rate test (the same detector with floor 1: token-difr's
                 statistic) beside it; unseeded: `cfg.unseeded_detector` (pit-uniformity, or
                 xent-excess) fit the same way on honest runs sampled at the vendor's settings
                 (with seeds, claimed and scored without them), no mismatch-rate test
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from verinfer.core.auditor import AuditCore
from verinfer.core.completions import FIXED_SEEDS, probe_candidates, recognise_fixed_seed, seed_probe
from verinfer.core.local_runs import CHAT_BANDS, Band, chat_run_claims
from verinfer.audit.replay import resegmentation
from verinfer.core.sources import ChatSource, reply_claim, sampling_key
from verinfer.claims import Claim
from verinfer.detect.base import Detector
from verinfer.detect.calibrate import calibrate
from verinfer.detect.judge import judge_vendor
from verinfer.detect.summary import margin_clip, summarize
from verinfer.errors import VerinferError
from verinfer.models.load import model_info
from verinfer.models.prompts import CALIB_SEED_OFFSET, chat_messages
from verinfer.providers.chat_http import ChatEndpoint, request_chat
from verinfer.providers.openai_http import EndpointError
from verinfer.providers.simulated import HONEST, request_seed
from verinfer.retokenize import Retokenizer
from verinfer.sampling.params import SamplingParams

TOKEN_MODES = ("derived", "returned", "auto")
BAND_ENGINES = ("verinfer", "vllm")  # who runs the reference bands: verinfer's engine, or local vLLM (DiFR's way)
CHAT_MODES = ("auto", "seeded", "greedy")  # what a sampled chat audit is told (auto: the seed probe decides)
JUDGED_MODES = ("greedy", "seeded", "unseeded")  # what a claim is judged in
UNSEEDED_DETECTORS = ("pit-uniformity", "xent-excess")  # `detect.unseeded`: the unseeded mode's detector (first: default)
UNSEEDED_NOTE = "unseeded, judged from the reference's distribution alone"
FIXED_NOISE_NOTE = ("not judged: its replies do not change with the seed (the same reply to the same seed and to "
                    "another), so it samples every request with one seed of its own (or a cache answers) and all its "
                    "draws share one noise stream: an unseeded test, which assumes independent draws, would be "
                    "invalid and could flag an honest vendor")
FIXED_NOISE_FIX = ("declare its sampler in the vendors file: mode = \"seeded\", noise = \"<its sampler>\" and "
                   "fixed_seed = <the seed it samples every request with>")
PROBE_TOKENS = 32            # max_tokens of the seed probe's requests
PROBE_SEED_INDEX = 10**6     # the probe's seeds: request_seed(seed, PROBE_SEED_INDEX + 0 / 1)
GREEDY_NOISE = "vllm-cpu"    # what a greedy claim names (no noise is drawn)


@dataclass(frozen=True)
class ChatSampling:
    """The sampling a vendor is audited at: temperature 0 (greedy), or temperature / top-p / top-k /
    min-p with a per-request seed and `noise`, the sampler the vendor is declared (or, mode auto,
    first guessed) to draw with. mode: auto (the seed probe decides), seeded (trust `noise`), greedy.
    fixed_seed: the one seed the vendor samples every request with (whatever the request's): every
    request asks it and every claim states it. `key` and `settings` leave it out (a detector and the
    bands do not depend on which seed a vendor samples with: they are run at their own seeds,
    `ChatAudit._local`); the claims and the collection's manifest carry it."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    noise: str = GREEDY_NOISE
    mode: str = "auto"
    unseeded: bool = False   # judged without seeds (the vendor ignores them, or no known sampler reproduces them)
    fixed_seed: int | None = None  # the seed a fixed-seed vendor samples every request with (None: the request's)

    def __post_init__(self):
        if self.mode not in CHAT_MODES:
            raise VerinferError(f"mode must be one of {', '.join(CHAT_MODES)}, got {self.mode!r}")
        if self.mode == "greedy" and self.temperature != 0:
            raise VerinferError(f"mode greedy asks temperature 0, got {self.temperature}",
                                fix="drop --mode greedy (or the vendor's mode), or audit at --temperature 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise VerinferError(f"top_k must be an integer, got {self.top_k!r}")
        if self.fixed_seed is not None and (isinstance(self.fixed_seed, bool) or not isinstance(self.fixed_seed, int)
                                            or self.fixed_seed < 0):
            raise VerinferError(f"fixed_seed must be an integer >= 0, got {self.fixed_seed!r}",
                                fix="the seed the vendor samples every request with, e.g. fixed_seed = 42")
        try:
            self.params(0, 1)
        except ValueError as e:
            raise VerinferError(f"sampling: {e}", fix="check --temperature, --top-p, --top-k, --min-p, --noise") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def params(self, seed: int | None, max_tokens: int) -> SamplingParams:
        """A request's sampling (greedy: no seed, filters off; unseeded: the claim's, no seed and no
        noise, `SamplingParams.unseeded`; a fixed seed replaces `seed`)."""
        if self.greedy:
            return SamplingParams(0.0, -1, 1.0, 0.0, None, max_tokens, GREEDY_NOISE)
        if self.unseeded:
            return SamplingParams(float(self.temperature), self.top_k if self.top_k > 0 else -1, float(self.top_p),
                                  float(self.min_p), None, max_tokens, None, unseeded=True)
        return SamplingParams(float(self.temperature), self.top_k if self.top_k > 0 else -1, float(self.top_p),
                              float(self.min_p), seed if self.fixed_seed is None else self.fixed_seed, max_tokens,
                              self.noise)

    def request(self, seed: int | None, max_tokens: int) -> SamplingParams:
        """What a request asks: `params`, with the seed even where the claim is judged unseeded (a
        vendor that ignores it loses nothing, and its claim states no seed)."""
        return replace(self, unseeded=False).params(seed, max_tokens) if self.unseeded else self.params(seed, max_tokens)

    def settings(self) -> dict:
        """What a seeded claim is replayed with (greedy: {"temperature": 0.0}; unseeded: noise None)."""
        if self.greedy:
            return {"temperature": 0.0}
        p = self.params(0, 1)
        return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p, "noise": p.noise}

    def key(self) -> str:
        """A file-name-safe name of the settings: 'greedy', 'seeded-t0.7-p0.95-k-1-m0-vllm-cpu' or
        'unseeded-t0.7-p0.95-k-1-m0'."""
        return sampling_key(self.params(0, 1))

    @classmethod
    def of(cls, params: SamplingParams) -> "ChatSampling":
        """The sampling of a claim's params (its seed and max_tokens aside)."""
        if params.greedy:
            return cls()
        if params.unseeded:
            return cls(params.temperature, params.top_p, params.top_k, params.min_p, mode="auto", unseeded=True)
        return cls(params.temperature, params.top_p, params.top_k, params.min_p, params.noise, "seeded")


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
    temperature: float = 0.0          # the sampling every vendor is audited at (a vendors file may set its own):
    top_p: float = 1.0                #   temperature 0 is greedy; > 0 needs seeds (mode auto probes for them)
    top_k: int = -1
    min_p: float = 0.0
    noise: str = GREEDY_NOISE         # the declared sampler (mode seeded), or the probe's first candidate (auto)
    mode: str = "auto"                # auto | seeded | greedy (`ChatSampling`)
    unseeded_detector: str = UNSEEDED_DETECTORS[0]  # what judges unseeded vendors and exchanges (UNSEEDED_DETECTORS)

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
        if self.unseeded_detector not in UNSEEDED_DETECTORS:
            raise VerinferError(f"unseeded_detector must be one of {', '.join(UNSEEDED_DETECTORS)}, got "
                                f"{self.unseeded_detector!r}", fix="--unseeded-detector pit-uniformity (the default) "
                                                                   "or xent-excess")
        self.sampling  # validated

    @property
    def params(self) -> SamplingParams:
        """A greedy request's sampling (what a log's greedy exchanges are claimed with)."""
        return ChatSampling().params(None, self.max_tokens)

    @property
    def sampling(self) -> ChatSampling:
        return ChatSampling(self.temperature, self.top_p, self.top_k, self.min_p, self.noise, self.mode)

    def sampling_for(self, endpoint: ChatEndpoint) -> ChatSampling:
        """The vendor's sampling: the audit's, with the fields its vendors file sets (its mode greedy
        alone: temperature 0)."""
        own = dict(endpoint.sampling)
        if own.get("mode") == "greedy":
            own.setdefault("temperature", 0.0)
        try:
            return replace(self.sampling, **own)
        except VerinferError as e:
            raise VerinferError(f"vendor {endpoint.name!r}: {e.what}", fix=e.fix) from None

    def settings(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


@dataclass
class VendorResult:
    """One vendor's row of the dashboard (`vendors.json`); the fields after `served_model` are
    `detect.judge.judge_vendor`'s."""

    name: str
    base_url: str
    served_model: str
    mode: str = "greedy"               # greedy | seeded | unseeded (JUDGED_MODES)
    sampling: dict | None = None       # ChatSampling.settings() of a sampled audit
    probe: dict | None = None          # the seed probe's record (mode auto)
    note: str | None = None            # unseeded: why; seeded: what the probe could not establish
    n_claims: int = 0
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


def collect_manifest(endpoint: ChatEndpoint, cfg: ChatAuditConfig, conversations: list[list[dict]],
                     sampling: ChatSampling | None = None, mode: str = "greedy") -> dict:
    """What identifies a vendor's collection: its name, served model and request fields (its URL and
    key may change between runs), and what was asked (a sampled audit: its settings, seed and mode)."""
    h = hashlib.sha256(json.dumps(conversations).encode()).hexdigest()[:16]
    m = {"name": endpoint.name, "model": endpoint.model, "extra": endpoint.extra, "max_tokens": cfg.max_tokens,
         "temperature": 0.0, "tokens": cfg.tokens, "conversations_sha256": h}
    if sampling is not None and not sampling.greedy:
        m.update(sampling.settings(), seed=cfg.seed, mode=mode)
        if sampling.fixed_seed is not None:
            m["fixed_seed"] = sampling.fixed_seed
    return m


def request_params(cfg: ChatAuditConfig, sampling: ChatSampling, n: int) -> list[SamplingParams]:
    """Each conversation's request: greedy, or sampled with seed request_seed(cfg.seed, i) (a fixed-seed
    vendor's: its `fixed_seed`, every request)."""
    return [sampling.request(None if sampling.greedy else request_seed(cfg.seed, i), cfg.max_tokens) for i in range(n)]


def chat_source(endpoint: ChatEndpoint, cfg: ChatAuditConfig, conversations: list[list[dict]],
                retok: Retokenizer, info=None, sampling: ChatSampling | None = None,
                mode: str = "greedy") -> ChatSource:
    """A vendor's requests as a collection source (`request_params`: greedy unless `sampling` is
    sampled; cfg.max_tokens, cfg.tokens), its claims tagged with `mode`; info: the trusted model's
    `model_info` when the caller has it (reading it hashes the weights)."""
    info = info or model_info(cfg.model_dir)
    sampling = sampling or ChatSampling()
    return ChatSource(endpoint, conversations, request_params(cfg, sampling, len(conversations)), cfg.tokens, retok,
                      info.name, info.vocab_size, collect_manifest(endpoint, cfg, conversations, sampling, mode),
                      mode=mode)


class ChatAudit:
    """An audit's shared parts on one `AuditCore`: the tokenizer, the calibrated detectors and the
    reference bands of each sampling (computed once, cached in out_dir), then any number of vendors."""

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
        self.seen: dict[str, tuple[Detector, dict]] = {}  # sampling key -> (detector, bands) of the vendors so far

    def _local(self, names: dict[str, Band], sub: str, conv: list[list[dict]],
               max_tokens: list[int] | None = None, engine: str = "verinfer",
               sampling: ChatSampling | None = None, seeds: list[int] | None = None) -> dict[str, pa.Table]:
        cfg = self.cfg  # local runs sample at their own seeds, never a vendor's fixed one
        sampling = replace(sampling, fixed_seed=None) if sampling else ChatSampling()
        params = sampling.params(None if sampling.greedy else 0, cfg.max_tokens)
        return {name: self.core.scores(chat_run_claims(band, name, cfg.model_dir, params, conv, self.retok,
                                                       self.out / sub, self.info.name, max_tokens=max_tokens,
                                                       engine=engine, device=cfg.device, show_progress=self.core.show,
                                                       seeds=None if sampling.greedy else seeds))
                for name, band in names.items()}

    def detector(self, sampling: ChatSampling | None = None, calibration: tuple | None = None) -> Detector:
        """The mismatch-and-margin detector fit on the honest configurations' chat runs at `sampling`
        (default greedy; cached in out_dir/detector.json, a sampled one in detector-<key>.json, with
        the settings it was made for); unseeded sampling: `cfg.unseeded_detector`, fit on the honest
        runs at that sampling claimed without their seeds (detector-unseeded-<...>.json).
        calibration: (conversations, max_tokens) to run them on (default: self.calibration, else
        fresh prompts)."""
        if sampling is not None and sampling.unseeded:
            calibration = calibration or self.calibration or cycled(self.conversations, self.max_tokens, self.cfg.calib_n)
            return self._fit("detector", self.cfg.unseeded_detector, {}, sampling, calibration)
        return self._fit("detector", "greedy", {}, sampling, calibration)

    def mismatch_detector(self, sampling: ChatSampling | None = None,
                          calibration: tuple | None = None) -> Detector | None:
        """The calibrated mismatch-rate test (the greedy detector with floor 1: every mismatch counts 1,
        token-difr's statistic with verinfer's pass line and the same null), fit on the same honest
        runs; out_dir/mismatch_detector.json (sampled: mismatch_detector-<key>.json). None unseeded:
        a sampled token without its seed has no mismatch to count."""
        if sampling is not None and sampling.unseeded:
            return None
        return self._fit("mismatch_detector", "greedy", {"floor": 1.0}, sampling, calibration)

    def _fit(self, base: str, kind: str, options: dict, sampling: ChatSampling | None,
             calibration: tuple | None) -> Detector:
        cfg, sampling = self.cfg, sampling or ChatSampling()
        calibration = calibration or self.calibration
        name = f"{base}.json" if sampling.greedy else f"{base}-{sampling.key()}.json"
        meta = {"model_weights_sha256": self.info.weights_sha256, "max_tokens": cfg.max_tokens,
                "honest": list(cfg.honest), "calib_n": cfg.calib_n, "seed": cfg.seed,
                "system_prompt": cfg.system_prompt, "target_fpr": cfg.target_fpr, "matmul": cfg.matmul,
                "detector": kind, "options": options}
        if not sampling.greedy:
            meta["sampling"] = sampling.settings()
        if calibration is not None:
            meta["calibration_sha256"] = hashlib.sha256(json.dumps(calibration).encode()).hexdigest()[:16]

        def fit() -> Detector:
            t0 = time.perf_counter()
            base_seed = cfg.seed + CALIB_SEED_OFFSET
            conv, lengths = calibration or (chat_messages(cfg.calib_n, base_seed, cfg.system_prompt), None)
            sub = "calibration" if sampling.greedy else f"calibration-{sampling.key()}"
            tables = self._local({h: Band.honest(h) for h in cfg.honest}, sub, conv, lengths, sampling=sampling,
                                 seeds=[request_seed(base_seed, i) for i in range(len(conv))])
            det = calibrate(pa.concat_tables(tables.values()), list(cfg.honest), detector=kind,
                            target_fpr=cfg.target_fpr, seed=cfg.seed, **options)
            self.timings[f"calibration_{Path(name).stem}_s"] = time.perf_counter() - t0  # detector, mismatch_detector
            return det

        return self.core.detector(self.out / name, meta, fit)

    def bands(self, det: Detector, sampling: ChatSampling | None = None,
              conversations: list[list[dict]] | None = None, max_tokens: list[int] | None = None,
              seeds: list[int] | None = None) -> dict:
        """Each band run on the vendors' own conversations (a score's level depends on the prompts), at
        `sampling` (sampled: conversation i with seeds[i], default the vendors' request_seed(seed, i))."""
        t0 = time.perf_counter()
        sampling = sampling or ChatSampling()
        conv = conversations or self.conversations
        if not sampling.greedy and self.cfg.band_engine != "verinfer":
            raise VerinferError("sampled chat audits run their reference bands on verinfer's engine",
                                fix="drop --band-engine vllm (it runs greedy bands only)")
        sub = "bands" if self.cfg.band_engine == "verinfer" else f"bands-{self.cfg.band_engine}"
        sub += "" if sampling.greedy else f"-{sampling.key()}"
        seeds = seeds or [request_seed(self.cfg.seed, i) for i in range(len(conv))]
        tables = self._local({b: CHAT_BANDS.get(b) for b in self.cfg.bands}, sub, conv,
                             max_tokens if conversations is not None else self.max_tokens, self.cfg.band_engine,
                             sampling, seeds)
        out = {name: {**summarize(t, margin_clip(det), seed=self.cfg.seed),
                      "description": CHAT_BANDS.get(name).description} for name, t in tables.items()}
        self.timings["bands_s" if sampling.greedy else f"bands_{sampling.key()}_s"] = time.perf_counter() - t0
        return out

    def judged_at(self, sampling: ChatSampling) -> tuple[Detector, dict]:
        """(detector, bands) of the vendors' conversations at `sampling`, each computed once."""
        key = sampling.key()
        if key not in self.seen:
            det = self.detector(sampling)
            self.seen[key] = (det, self.bands(det, sampling))
        return self.seen[key]

    def probe_vendor(self, endpoint: ChatEndpoint, sampling: ChatSampling, out: Path) -> tuple[str, ChatSampling, dict | None]:
        """(mode, sampling, the probe's record) of a vendor: greedy at temperature 0, seeded as
        declared with mode seeded, else (auto) the seed probe (`core.completions.seed_probe`) on the
        first conversation at max(temperature, 1) (a seed matters) and PROBE_TOKENS tokens: seeds
        honoured and a known backend reproduces the reply -> seeded with that backend; fixed noise (the
        reply unchanged by the seed, `fixed_noise`) -> the probe's reply replayed at each of FIXED_SEEDS
        (a declared `fixed_seed` first; `completions.recognise_fixed_seed`): one reproduces it -> seeded with that backend and that
        `fixed_seed` on every claim, none -> mode "fixed-noise" (not judged: `vendor`); else unseeded (a
        vendor whose sampler verinfer does not know is never judged as if it sampled with another one:
        an honest vendor would be accused; `mode = "seeded"` with its `noise` forces the replay); the
        unseeded sampling is `ChatSampling.unseeded`. Kept in out/probe.json: a rerun asks nothing."""
        if sampling.greedy:
            return "greedy", sampling, None
        if sampling.mode == "seeded":
            return "seeded", sampling, None
        path = out / "probe.json"
        if path.is_file():
            record = json.loads(path.read_text())
        else:
            base = replace(sampling, temperature=max(sampling.temperature, 1.0))
            params = [base.params(request_seed(self.cfg.seed, PROBE_SEED_INDEX + k), min(PROBE_TOKENS, self.cfg.max_tokens))
                      for k in (0, 0, 1)]
            client, msgs, claims = endpoint.client(), self.conversations[0], {}

            def ask(i: int):
                reply = request_chat(client, endpoint, msgs, params[i], f"seed probe request {i} of vendor "
                                                                         f"{endpoint.name!r}")
                claims[i] = reply_claim(i, msgs, reply, endpoint, params[i], self.cfg.tokens, self.retok,
                                        self.info.name, vocab_size=self.info.vocab_size)
                return (reply.text, reply.finish_reason), claims[i]

            candidates = probe_candidates(sampling.noise)
            record = seed_probe(ask, self.core.engine, candidates, self.retok)
            if record.get("fixed_noise"):
                seeds = tuple(dict.fromkeys([s for s in (sampling.fixed_seed,) if s is not None] + list(FIXED_SEEDS)))
                record.update(recognise_fixed_seed(claims[0], self.core.engine, candidates, seeds, self.retok))
                record["mode"] = "seeded" if record["fixed_seed"] is not None else "fixed-noise"
            else:
                record["mode"] = "seeded" if record["honours_seeds"] and record["recognised"] else "unseeded"
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=1) + "\n")
        if record["mode"] == "seeded":
            sampling = replace(sampling, noise=record["noise"], fixed_seed=record.get("fixed_seed"))
        elif record["mode"] == "unseeded":
            sampling = replace(sampling, unseeded=True, fixed_seed=None)
        return record["mode"], sampling, record

    def vendor(self, endpoint: ChatEndpoint, det: Detector | None = None, bands: dict | None = None) -> VendorResult:
        """Probe (sampled, mode auto), collect (resuming), replay and judge one vendor; an endpoint
        error is the row's `error`. An unseeded vendor's replies are claimed without seed or noise
        (mode "unseeded") and judged by the unseeded detector calibrated at its sampling; its row's
        note says why it is unseeded. A fixed-seed vendor found at a seed of FIXED_SEEDS is judged
        seeded at that seed (its note says so). One whose replies do not change with the seed at no
        such seed (probe mode "fixed-noise") is not judged and nothing more is sent: its row has no
        verdict, its note `FIXED_NOISE_NOTE` with `FIXED_NOISE_FIX`, and the same text as its `error`:
        the one row state every report shows as "could not be audited" (vendors.md and the CLI
        table: error; the dashboard: error, counted apart from ok and flagged) and the CLI exits 2
        on (never 1, flagged, nor 0, ok). det, bands: the greedy audit's (default: `judged_at` the
        vendor's sampling)."""
        row = VendorResult(endpoint.name, endpoint.base_url, endpoint.model)
        out = self.out / "vendors" / endpoint.name
        try:
            mode, sampling, probe = self.probe_vendor(endpoint, self.cfg.sampling_for(endpoint), out)
        except (EndpointError, VerinferError) as e:
            row.error = str(e)
            return row
        row.mode, row.probe = ("seeded" if mode == "fixed-noise" else mode), probe
        row.sampling = None if sampling.greedy else sampling.settings()
        if mode == "fixed-noise":
            tried = ", ".join(probe.get("fixed_seed_exact_match", {}))
            row.note = (f"{FIXED_NOISE_NOTE}; no known sampler reproduces its reply at the seeds tried ({tried}) -> "
                        f"{FIXED_NOISE_FIX}")
            row.error = row.note
            return row
        if mode == "unseeded":
            row.note = f"{UNSEEDED_NOTE}: {unseeded_reason(probe)}"
        if sampling.fixed_seed is not None:
            row.sampling = {**row.sampling, "fixed_seed": sampling.fixed_seed}
            if probe is not None and probe.get("fixed_noise"):
                row.note = (f"samples every request with seed {sampling.fixed_seed} whatever the request's (its "
                            f"replies do not change with the seed; {sampling.noise} reproduces its reply at "
                            f"{sampling.fixed_seed}): judged seeded at that seed")
        if det is None or not sampling.greedy:
            det, bands = self.judged_at(sampling)
        stop = (self.core.stream(det, self.cfg.target_fpr, out / "claims.jsonl", out / "scores.parquet",
                                 every=endpoint.concurrency) if self.cfg.sequential else None)
        try:
            claims, sent = self.core.collect(chat_source(endpoint, self.cfg, self.conversations, self.retok,
                                                         self.info, sampling, mode), out,
                                             f"{endpoint.name}: requests", stop)
        except (EndpointError, VerinferError) as e:
            row.error = str(e)
            return row
        return self.judge(row, claims, sent, out, det, bands,
                          stopped_early=self.cfg.sequential and sent < len(self.conversations), sampling=sampling)

    def judge(self, row: VendorResult, claims: list[Claim], sent: int, out: Path, det: Detector,
              bands: dict, stopped_early: bool = False, sampling: ChatSampling | None = None,
              calibration: tuple | None = None) -> VendorResult:
        """Replay a vendor's claims (out/claims.jsonl, the stop rule's parts read, not replayed
        again) and fill its row (`detect.judge.judge_vendor`, with the mismatch-rate test at the same
        `sampling`) and how its claims' tokens were obtained. stopped_early: its requests stopped
        before the last conversation."""
        table = self.core.scores(out / "claims.jsonl", out / "scores.parquet", keep_parts=True)
        judged = judge_vendor(table, det, self.mismatch_detector(sampling, calibration), alpha=self.cfg.target_fpr,
                              bands=bands, name=row.name, seed=self.cfg.seed, stopped_early=stopped_early)
        for key, value in judged.items():
            setattr(row, key, value)
        row.n_requests, row.n_claims = int(sent), len(claims)
        row.retokenized = float(np.mean([c.derived for c in claims]))
        row.resegmented, row.drift = resegmentation(claims, table)
        return row


def cycled(conversations: list[list[dict]], max_tokens: list[int] | None, n: int) -> tuple[list, list[int] | None]:
    """(conversations, max_tokens) repeated in turn up to n runs: what an unseeded detector is
    calibrated on (the vendors' own conversations, each sampled again with other seeds: under
    honest sampling a reply's PIT values are uniform whatever the prompt, so the honest runs of the
    same prompts are the null of the vendor's)."""
    idx = [i % len(conversations) for i in range(n)]
    return [conversations[i] for i in idx], None if max_tokens is None else [max_tokens[i] for i in idx]


def unseeded_reason(probe: dict | None) -> str:
    """Why the probe found a vendor unseeded, in words."""
    if probe is None:
        return "no seed, or no declared sampler"
    if not probe.get("same_seed_same_reply", True):
        return "the same seeded request twice gave two different replies: the vendor ignores seeds"
    if not probe.get("other_seed_other_reply", True):
        return "two different seeds gave the same reply: the vendor ignores seeds"
    if probe.get("honours_seeds") and not probe.get("recognised", True):
        return (f"the vendor honours seeds, but no known sampler reproduces its seeded reply (exact match by "
                f"backend: {probe.get('probe_exact_match')}); mode seeded with its noise forces a seeded replay")
    return "the seed probe found no usable seed"


__all__ = ["BAND_ENGINES", "CHAT_MODES", "FIXED_NOISE_FIX", "FIXED_NOISE_NOTE", "ChatAudit", "ChatAuditConfig",
           "ChatSampling", "JUDGED_MODES",
           "TOKEN_MODES", "UNSEEDED_DETECTORS", "UNSEEDED_NOTE", "VendorResult", "chat_source", "collect_manifest",
           "cycled", "request_params", "unseeded_reason"]
