"""Audit the chat endpoints people buy from (DiFR appendix D, the authors' `token-difr`, Moonshot's
K2 Vendor Verifier), one vendor or several side by side, at temperature 0, from the text they return.

    prompts      `models.prompts.chat_messages`: questions about held-out code and arithmetic, the
                 same for every vendor (and the auditor's system prompt, if any)
    collect      each vendor's `/v1/chat/completions` (`providers.chat_http`), `concurrency` requests
                 in flight, every reply saved as it arrives (resumable per vendor); a claim per
                 reply, its ids derived from the text (`retokenize`) or, with tokens="returned",
                 the endpoint's own where it sends them
    replay       the trusted local model replays each claim (re-cutting derived ids where it spells
                 the same text with other tokens: `audit.replay.recut_claims`)
    verdict      the greedy detector (`detect.greedy`: each mismatch counted, plus its margin up to
                 where honest near-ties end) calibrated on verinfer's own honest greedy runs of the
                 same kind of chat prompts (other prompts; each honest configuration one group of
                 the null; held-out false-positive rate stated), streamed as an anytime-valid
                 e-process over claims (`detect.sequential`): requests stop as soon as a vendor is
                 flagged, and the tokens and requests that took are reported; beside it the
                 calibrated mismatch-rate test (token-difr's statistic with verinfer's pass line),
                 fixed-size and sequential, on the same claims
    bands        reference bands (DiFR figure 5): verinfer's own greedy runs of the vendors' prompts as
                 an honest provider (bf16) and as misconfigured ones (fp8 KV cache, 8-bit and 4-bit
                 weights, an extra system prompt, another chat template), replayed and summarized
                 like a vendor; each vendor's nearest band by mean clipped margin and cross-entropy

Outputs in out_dir: calibration/ and bands/ (local runs, scored), vendors/<name>/ (claims.jsonl,
collect.json, scores.parquet), detector.json, vendors.json (the dashboard's input), vendors.md and
vendors.html. Rerunning the same command resumes; another audit's directory is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa

from verinfer._version import __version__
from verinfer.audit.replay import StreamRows
from verinfer.apps.collect import collect
from verinfer.apps.pipeline import VERIFIER_NUMERICS, score, scores_current, verifier_engine
from verinfer.claims import Claim, claims_text, write_claims
from verinfer.detect.calibrate import calibrate
from verinfer.detect.base import Detector
from verinfer.detect.greedy import GreedyDetector
from verinfer.detect.base import block_sizes
from verinfer.detect.sequential import SequentialAudit, StreamingAudit
from verinfer.detect.cache import DetectorCache
from verinfer.detect.summary import margin_clip, nearest_band, summarize
from verinfer.errors import VerinferError
from verinfer.io import atomic_write_json, atomic_write_text, check_writable, exclusive_lock
from verinfer.models.load import model_info
from verinfer.models.prompts import CALIB_SEED_OFFSET, chat_messages
from verinfer.numerics import Numerics
from verinfer.progress import progress_bar
from verinfer.providers.chat_http import ChatEndpoint, ChatReply, read_vendors, request_chat
from verinfer.providers.chat_log import iter_chat_log, unusable_for_replay
from verinfer.providers.openai_http import EndpointError, check_token_reply
from verinfer.providers.simulated import HONEST, ProviderConfig, provider_generate
from verinfer.registry import Registry
from verinfer.retokenize import DERIVED, PLAIN_CHAT_TEMPLATE, RETURNED, Retokenizer
from verinfer.sampling.params import SamplingParams
from verinfer.scores import CLAIM_ID, CROSS_ENTROPY, EXACT_MATCH, MARGIN, TOKEN_ID, load_score_tables

TOKEN_MODES = ("derived", "returned", "auto")
BAND_ENGINES = ("verinfer", "vllm")  # who runs the reference bands: verinfer's engine, or local vLLM (DiFR's way)
BAND_SYSTEM_PROMPT = "You are a helpful assistant. Keep your answers short and follow the instructions."


@dataclass(frozen=True)
class Band:
    """A local configuration an auditor runs as a reference: a provider's numerics, and what it does
    to the conversation (an extra system message, another chat template). The claim always states
    the plain conversation, as a vendor's does."""

    provider: ProviderConfig
    description: str
    system_prompt: str | None = None
    chat_template: str | None = None
    vllm_run: str = "honest"          # the same configuration on real vLLM (providers.vllm.VLLM_RUNS)


BANDS: Registry[Band] = Registry("reference band", {
    "bf16": Band(HONEST.get("honest-bf16-b8"), "honest: bf16, batches of 8"),
    "fp8-kv": Band(ProviderConfig("fp8-kv", Numerics(dtype="bf16", kv_cache="fp8_e4m3"), honest=False),
                   "fp8 e4m3 KV cache", vllm_run="fp8-kv"),
    "int8": Band(ProviderConfig("int8", Numerics(dtype="bf16", weight_bits=8), honest=False),
                 "8-bit weights (RTN, group 32)", vllm_run="int8"),
    "int4": Band(ProviderConfig("int4", Numerics(dtype="bf16", weight_bits=4), honest=False),
                 "4-bit weights (RTN, group 32)", vllm_run="int4"),
    "system-prompt": Band(HONEST.get("honest-bf16-b8"), "an extra system prompt", system_prompt=BAND_SYSTEM_PROMPT),
    "template": Band(HONEST.get("honest-bf16-b8"), "another chat template (plain 'role: content')",
                     chat_template=PLAIN_CHAT_TEMPLATE),
})


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
    bands: tuple[str, ...] = tuple(BANDS)
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
            BANDS.get(name)

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(0.0, -1, 1.0, 0.0, None, self.max_tokens, "vllm-cpu")

    def settings(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


@dataclass
class VendorResult:
    """One vendor's row of the dashboard (`vendors.json`)."""

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


@dataclass
class ChatAuditResult:
    vendors: list[VendorResult]
    bands: dict
    path: Path                        # vendors.json
    html: Path | None
    timings: dict = field(default_factory=dict)

    def vendor(self, name: str) -> VendorResult:
        return next(v for v in self.vendors if v.name == name)


# --- the vendors file ---------------------------------------------------------------------------
# --- local runs: calibration and bands --------------------------------------------------------
def local_chat_claims(band: Band, name: str, cfg: ChatAuditConfig, conversations: list[list[dict]],
                      retok: Retokenizer, out: Path, show_progress: bool = True,
                      max_tokens: list[int] | None = None, engine: str = "verinfer") -> Path:
    """Claims of a local run (cached at out/<name>.jsonl): the conversations as the band runs them
    (its system prompt, its template), greedy (each with its max_tokens, cfg.max_tokens by
    default; on verinfer's engine, or engine "vllm": on local vLLM), then each reply claimed as a
    vendor's is, from its text, against the plain conversation."""
    path = out / f"{name}.jsonl"
    if path.is_file():
        return path
    run_retok = Retokenizer(retok.tokenizer, retok.end_token_id, band.chat_template)
    run_msgs = [([{"role": "system", "content": band.system_prompt}] if band.system_prompt else []) + list(m)
                for m in conversations]
    prompts = [run_retok.prompt_ids(m) for m in run_msgs]
    params = [replace(cfg.params, max_tokens=m) for m in (max_tokens or [cfg.max_tokens] * len(prompts))]
    with progress_bar(f"{out.name}: generate {name}", len(prompts), show_progress) as adv:
        if engine == "vllm":
            from verinfer.providers.vllm import VllmRun, generate_greedy

            out.mkdir(parents=True, exist_ok=True)
            done = generate_greedy(cfg.model_dir, VllmRun.named(band.vllm_run), prompts, [p.max_tokens for p in params],
                                   out, progress=adv)
        else:
            done = [(list(c.output_token_ids), c.finish_reason) for c in
                    provider_generate(band.provider, cfg.model_dir, prompts, params, device=cfg.device, progress=adv)]
    info = model_info(cfg.model_dir)
    claims = []
    for i, (msgs, (ids, finish)) in enumerate(zip(conversations, done)):
        stopped = finish == "stop"
        text = retok.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)
        if not text:
            continue
        claims.append(Claim.from_chat(f"{name}-{i:05d}", info.name, msgs, text, "stop" if stopped else "length",
                                      params[i], retok, returned=(prompts[i], ids), provider=name))
    out.mkdir(parents=True, exist_ok=True)
    write_claims(path, claims)
    return path


# --- collection -------------------------------------------------------------------------------
def _collect_manifest(endpoint: ChatEndpoint, cfg: ChatAuditConfig, conversations: list[list[dict]]) -> dict:
    h = hashlib.sha256(json.dumps(conversations).encode()).hexdigest()[:16]
    # the vendor by name, served model and request fields (its URL and key may change between runs)
    return {"name": endpoint.name, "model": endpoint.model, "extra": endpoint.extra, "max_tokens": cfg.max_tokens,
            "temperature": 0.0, "tokens": cfg.tokens, "conversations_sha256": h}


def reply_claim(i: int, msgs: list[dict], reply: ChatReply, endpoint: ChatEndpoint, cfg: ChatAuditConfig,
                retok: Retokenizer, model_name: str, *, vocab_size: int) -> Claim | None:
    """The claim of reply i. Where its ids are the endpoint's (tokens "returned", or "auto" with ids
    sent), they are checked against the trusted model's vocab_size and max_tokens first
    (`openai_http.check_token_reply`): a bad reply is an EndpointError, never a claim. A request
    with stop strings (`extra["stop"]`): a reply that stopped is claimed as possibly cut by one
    (`Claim.from_chat` stop), and one cut before any text is no claim (None)."""
    tokens = cfg.tokens
    if tokens == "auto":
        tokens = RETURNED if reply.output_token_ids is not None else DERIVED
    if tokens == RETURNED and reply.output_token_ids is None:
        raise EndpointError(f"request {i}: the endpoint returned no token ids (tokens='returned')",
                            where=endpoint.name, fix="audit with tokens derived from the text (the default)")
    if tokens == RETURNED:
        check_token_reply(reply.output_token_ids, reply.finish_reason, vocab_size=vocab_size,
                          max_tokens=cfg.params.max_tokens, request=f"request {i} of vendor {endpoint.name!r}",
                          where=endpoint.name, prompt_ids=reply.prompt_token_ids)
    stop = endpoint.extra.get("stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if tokens == DERIVED and stop and reply.finish_reason == "stop" and not reply.text:
        return None
    return Claim.from_chat(f"{endpoint.name}-{i:05d}", model_name, msgs, reply.text, reply.finish_reason, cfg.params,
                           retok, tokens=tokens, returned=(reply.prompt_token_ids, reply.output_token_ids),
                           usage=reply.usage, provider=endpoint.name,
                           extra={"served_model": reply.served_model} if reply.served_model else None, stop=stop)


class ChatSource:
    """A vendor's requests (`apps.collect.Source`): each conversation to its `/v1/chat/completions`,
    `endpoint.concurrency` in flight; a reply becomes a claim by `reply_claim` (a reply cut before
    any text is none)."""

    def __init__(self, endpoint: ChatEndpoint, cfg: ChatAuditConfig, conversations: list[list[dict]],
                 retok: Retokenizer):
        self.endpoint, self.cfg, self.conversations, self.retok = endpoint, cfg, conversations, retok
        self.manifest = _collect_manifest(endpoint, cfg, conversations)
        self.concurrency = endpoint.concurrency
        self.info = model_info(cfg.model_dir)
        self.client = endpoint.client()

    def __len__(self) -> int:
        return len(self.conversations)

    def claim_id(self, i: int) -> str:
        return f"{self.endpoint.name}-{i:05d}"

    def send(self, i: int) -> ChatReply:
        return request_chat(self.client, self.endpoint, self.conversations[i], self.cfg.params,
                            f"request {i} of vendor {self.endpoint.name!r}")

    def claim(self, i: int, reply: ChatReply) -> Claim | None:
        return reply_claim(i, self.conversations[i], reply, self.endpoint, self.cfg, self.retok, self.info.name,
                           vocab_size=self.info.vocab_size)

    def interrupted(self, what: str, saved: int, path: Path) -> str:
        return f"{what} ({saved} of {len(self)} replies saved in {path}; rerun to resume)"

    def check_collected(self, claims: list[Claim]) -> None:
        return None


def collect_vendor(endpoint: ChatEndpoint, cfg: ChatAuditConfig, conversations: list[list[dict]],
                   retok: Retokenizer, out: Path, progress=None,
                   stop: Callable[[list[Claim]], bool] | None = None) -> tuple[list[Claim], int]:
    """(claims, requests sent) of one vendor (`apps.collect.collect` of a `ChatSource`): each
    conversation not yet in out/claims.jsonl sent, `endpoint.concurrency` at a time, claims saved in
    conversation order as replies arrive (under a lock: a second audit of the same directory is
    refused). stop(claims) after each new claim (and once on resumed ones): True cancels the
    requests not yet sent (those in flight are counted)."""
    return collect(ChatSource(endpoint, cfg, conversations, retok), out, progress, stop)


# --- the audit --------------------------------------------------------------------------------
class ChatAudit:
    """An audit's shared parts: the trusted engine, the tokenizer, the calibrated detector and the
    reference bands (computed once, cached in out_dir), then any number of vendors."""

    def __init__(self, cfg: ChatAuditConfig, show_progress: bool = True,
                 conversations: list[list[dict]] | None = None, max_tokens: list[int] | None = None):
        check_writable(cfg.out_dir, "audit directory", directory=True)
        self.cfg, self.show = cfg, show_progress
        self.out = Path(cfg.out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.info = model_info(cfg.model_dir)
        self.retok = Retokenizer.for_model(cfg.model_dir)
        self.engine = verifier_engine(cfg.model_dir, VERIFIER_NUMERICS.with_(matmul=cfg.matmul), device=cfg.device)
        self.conversations = conversations or chat_messages(cfg.n, cfg.seed, cfg.system_prompt)
        self.max_tokens = max_tokens  # per conversation (a log's), else cfg.max_tokens
        self.calibration = None       # (conversations, max_tokens) to calibrate on; None: fresh prompts
        self.timings: dict = {}

    def score_file(self, claims_path: Path, out: Path, keep_parts: bool = False) -> Path:
        """The replay of a claims file (skipped when `out` is newer; the parts a sequential audit's
        stop rule replayed are read, not replayed again). keep_parts: a vendor's claims, which a
        resumed audit extends (its stop rule then reads the parts instead of replaying them)."""
        if not scores_current(claims_path, out):
            score(claims_path, self.cfg.model_dir, out, engine=self.engine, show_progress=self.show,
                  retokenizer=self.retok, keep_parts=keep_parts)
        return out

    def stream_rows(self, claims_path: Path, out: Path) -> StreamRows:
        """The stop rule's replay of a claims file as it grows: its parts are `score_file`'s."""
        return StreamRows(lambda claims: score(claims_path, self.cfg.model_dir, out, engine=self.engine,
                                               show_progress=False, retokenizer=self.retok, claims=claims,
                                               growing=True))

    def _local(self, names: dict[str, Band], sub: str, conv: list[list[dict]],
               max_tokens: list[int] | None = None, engine: str = "verinfer") -> dict[str, pa.Table]:
        out = {}
        for name, band in names.items():
            path = local_chat_claims(band, name, self.cfg, conv, self.retok, self.out / sub, self.show, max_tokens,
                                     engine)
            out[name] = load_score_tables([self.score_file(path, path.with_suffix(".parquet"))])
        return out

    def detector(self) -> GreedyDetector:
        """The greedy detector fit on the honest configurations' greedy chat runs (cached in
        out_dir/detector.json with the settings it was made for); the mismatch-rate test fit on the
        same runs beside it (`mismatch_detector`)."""
        return self._fit("detector.json", "greedy", {})

    def mismatch_detector(self) -> Detector:
        """The calibrated mismatch-rate test (the greedy detector with floor 1: every mismatch counts 1,
        token-difr's statistic with verinfer's pass line and the same null), fit on the same honest
        runs; out_dir/mismatch_detector.json."""
        return self._fit("mismatch_detector.json", "greedy", {"floor": 1.0})

    def _fit(self, name: str, kind: str, options: dict) -> Detector:
        meta = {"model_weights_sha256": self.info.weights_sha256, "max_tokens": self.cfg.max_tokens,
                "honest": list(self.cfg.honest), "calib_n": self.cfg.calib_n, "seed": self.cfg.seed,
                "system_prompt": self.cfg.system_prompt, "target_fpr": self.cfg.target_fpr, "matmul": self.cfg.matmul,
                "detector": kind, "options": options}
        if self.calibration is not None:
            meta["calibration_sha256"] = hashlib.sha256(json.dumps(self.calibration).encode()).hexdigest()[:16]
        def fit() -> Detector:
            t0 = time.perf_counter()
            conv, lengths = self.calibration or (chat_messages(self.cfg.calib_n, self.cfg.seed + CALIB_SEED_OFFSET,
                                                               self.cfg.system_prompt), None)
            tables = self._local({h: Band(HONEST.get(h), HONEST.get(h).description) for h in self.cfg.honest},
                                 "calibration", conv, lengths)
            det = calibrate(pa.concat_tables(tables.values()), list(self.cfg.honest), detector=kind,
                            target_fpr=self.cfg.target_fpr, seed=self.cfg.seed, **options)
            self.timings[f"calibration_{Path(name).stem}_s"] = time.perf_counter() - t0  # detector, mismatch_detector
            return det

        return DetectorCache(self.out / name).get(meta, fit)

    def bands(self, det) -> dict:
        """Each band run on the vendors' own conversations (a score's level depends on the prompts)."""
        t0 = time.perf_counter()
        sub = "bands" if self.cfg.band_engine == "verinfer" else f"bands-{self.cfg.band_engine}"
        tables = self._local({b: BANDS.get(b) for b in self.cfg.bands}, sub, self.conversations, self.max_tokens,
                             self.cfg.band_engine)
        out = {name: {**summarize(t, margin_clip(det), seed=self.cfg.seed), "description": BANDS.get(name).description}
               for name, t in tables.items()}
        self.timings["bands_s"] = time.perf_counter() - t0
        return out

    def vendor(self, endpoint: ChatEndpoint, det: GreedyDetector, bands: dict) -> VendorResult:
        """Collect (resuming), replay and judge one vendor; an endpoint error is the row's `error`."""
        row = VendorResult(endpoint.name, endpoint.base_url, endpoint.model)
        out = self.out / "vendors" / endpoint.name
        seq = SequentialAudit(det, alpha=self.cfg.target_fpr)
        stop = (StreamingAudit(seq, self.stream_rows(out / "claims.jsonl", out / "scores.parquet"),
                               every=endpoint.concurrency) if self.cfg.sequential else None)
        try:
            with progress_bar(f"{endpoint.name}: requests", len(self.conversations), self.show) as adv:
                claims, sent = collect_vendor(endpoint, self.cfg, self.conversations, self.retok, out, adv, stop)
        except (EndpointError, VerinferError) as e:
            row.error = str(e)
            return row
        return self.judge(row, claims, sent, out, det, bands)

    def judge(self, row: VendorResult, claims: list[Claim], sent: int, out: Path, det: GreedyDetector,
              bands: dict) -> VendorResult:
        """Replay a vendor's claims (out/claims.jsonl, rescored when it has grown) and fill its row:
        the anytime-valid verdict over the claims in order, the fixed-size one beside it, the
        calibrated mismatch-rate test on the same claims, the summary, the nearest band, what
        deciding cost, and how the claims' tokens were obtained."""
        table = load_score_tables([self.score_file(out / "claims.jsonl", out / "scores.parquet", keep_parts=True)])
        v = SequentialAudit(det, alpha=self.cfg.target_fpr).verdict(table)
        point = summarize(table, margin_clip(det), seed=self.cfg.seed)
        row.verdict = v.with_(provider=row.name, fixed_n=det.verdict(table).to_dict()).to_dict()
        row.n_tokens, row.n_requests = int(table.num_rows), int(sent)
        row.exact_match = float(np.mean(table[EXACT_MATCH].to_numpy(zero_copy_only=False)))
        row.margin, row.cross_entropy, row.mismatch = point[MARGIN], point[CROSS_ENTROPY], point["mismatch"]
        row.nearest_band = nearest_band(point, bands)
        ends = np.cumsum(block_sizes(np.asarray(table[CLAIM_ID].to_pylist()), table.num_rows))
        row.tokens_to_decide, row.requests_to_decide = _decided(v.extra.get("decided_at_tokens"), ends)
        mm = self.mismatch_detector()
        mv = SequentialAudit(mm, alpha=self.cfg.target_fpr, lambdas=det.SEQUENTIAL_LAMBDAS,
                             null=det.SEQUENTIAL_NULL).verdict(table)
        fixed = mm.verdict(table)
        tokens, requests = _decided(mv.extra.get("decided_at_tokens"), ends)
        row.mismatch_test = {"flagged": mv.flagged, "p_value": mv.p_value, "tokens_to_decide": tokens,
                             "requests_to_decide": requests,
                             # requests stopped once verinfer's verdict decided: the test saw only those replies
                             "cut_short": bool(self.cfg.sequential and row.verdict["flagged"]
                                               and sent < len(self.conversations)),
                             "fixed_n": {"flagged": fixed.flagged, "p_value": fixed.p_value, "n_tokens": fixed.n_tokens}}
        row.retokenized = float(np.mean([c.derived for c in claims]))
        row.resegmented, row.drift = resegmentation(claims, table)
        return row


def _decided(tokens: int | None, ends: np.ndarray) -> tuple[int | None, int | None]:
    """(tokens, requests) at which a sequential audit decided (None, None if it did not)."""
    if tokens is None:
        return None, None
    return int(tokens), int(np.searchsorted(ends, tokens) + 1)


def resegmentation(claims: list[Claim], table: pa.Table) -> tuple[float | None, float | None]:
    """(fraction of derived claims the replay re-cut, fraction of derived claims whose canonical
    ids differ from the ids the endpoint returned, where it returned them: re-tokenization drift)."""
    derived = [c for c in claims if c.derived]
    if not derived:
        return None, None
    scored: dict[str, list[int]] = {}
    for cid, tok in zip(table[CLAIM_ID].to_pylist(), table[TOKEN_ID].to_pylist()):
        scored.setdefault(cid, []).append(tok)
    recut = float(np.mean([scored.get(c.id) != c.output_token_ids for c in derived]))
    known = [c for c in derived if "returned_output_token_ids" in c.chat]
    drift = float(np.mean([c.chat["returned_output_token_ids"] != c.output_token_ids for c in known])) if known else None
    return recut, drift


def audit_vendors(vendors: list[ChatEndpoint], cfg: ChatAuditConfig, *, show_progress: bool = True,
                  title: str | None = None) -> ChatAuditResult:
    """Audit each vendor with the same prompts against one calibrated detector and one set of
    reference bands; writes vendors.json, vendors.md and vendors.html in cfg.out_dir."""
    names = [v.name for v in vendors]
    if len(set(names)) != len(names) or not vendors:
        raise VerinferError(f"vendor names must be unique and at least one given, got {names}")
    t0 = time.perf_counter()
    audit = ChatAudit(cfg, show_progress)
    det = audit.detector()
    bands = audit.bands(det)
    rows = []
    for ep in vendors:
        t = time.perf_counter()
        rows.append(audit.vendor(ep, det, bands))
        audit.timings[f"vendor_{ep.name}_s"] = time.perf_counter() - t
    audit.timings["total_s"] = time.perf_counter() - t0
    return _write_results(audit, det, bands, rows,
                          title or f"verinfer audit of {len(vendors)} chat endpoint(s) serving {vendors[0].model}",
                          {"endpoints": [v.public() for v in vendors]})


def _write_results(audit: "ChatAudit", det, bands: dict, rows: list[VendorResult], title: str,
                   source: dict) -> ChatAuditResult:
    """vendors.json (the dashboard's input), vendors.md and vendors.html in the audit's directory."""
    cfg = audit.cfg
    doc = {"title": title, "model": rows[0].served_model if rows else "", "trusted_model": audit.info.name,
           "trusted_weights_sha256": audit.info.weights_sha256,
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "verinfer_version": __version__,
           "target_fpr": cfg.target_fpr, "mode": "greedy", "settings": cfg.settings(),
           "detector": {"summary": det.summary(), "heldout": _heldout(det)},
           "bands": bands, "vendors": [asdict(r) for r in rows], **source, "timings": audit.timings}
    from verinfer.report.vendors import render_vendors_html, render_vendors_markdown  # matplotlib: load when writing

    path = atomic_write_json(cfg.out_dir / "vendors.json", doc)
    atomic_write_text(cfg.out_dir / "vendors.md", render_vendors_markdown(doc))
    html = render_vendors_html(doc, cfg.out_dir / "vendors.html")
    return ChatAuditResult(rows, bands, path, html, audit.timings)


def audit_endpoint(base_url: str, model: str, cfg: ChatAuditConfig, *, name: str = "endpoint",
                   api_key_env: str | None = None, extra: dict | str | None = None, concurrency: int = 4,
                   timeout: float = 120.0, show_progress: bool = True) -> ChatAuditResult:
    """Audit one chat endpoint (`audit_vendors` with one vendor). api_key_env: the environment
    variable holding its key (default OPENAI_API_KEY when set); extra: request fields passed
    through (a dict, or JSON text)."""
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except json.JSONDecodeError as e:
            raise VerinferError(f"--extra is not JSON ({e.msg} at column {e.colno})",
                                fix='e.g. --extra \'{"provider": {"order": ["acme"]}}\'') from None
        if not isinstance(extra, dict):
            raise VerinferError("--extra must be a JSON object", fix='e.g. --extra \'{"top_k": 1}\'')
    if api_key_env is None and os.environ.get("OPENAI_API_KEY"):
        api_key_env = "OPENAI_API_KEY"
    ep = ChatEndpoint(name, base_url, model, api_key_env, dict(extra or {}), concurrency, timeout)
    return audit_vendors([ep], cfg, show_progress=show_progress, title=f"verinfer audit of {model} at {base_url}")


def log_claims(log: Path, cfg: ChatAuditConfig, retok: Retokenizer, *, skip_unusable: bool = False,
               skipped: list | None = None) -> dict[str, list[Claim]]:
    """The log's exchanges as claims, grouped by the model each reply names (its `model`, else the
    request's): ids derived from the text (or the ids the log holds, per cfg.tokens). Only greedy
    exchanges can be replayed without the provider's seed and sampler: temperature > 0 is unusable."""
    name = model_info(cfg.model_dir).name
    groups: dict[str, list[Claim]] = {}
    for ex in iter_chat_log(log, skip_unusable=skip_unusable, skipped=skipped):
        err = unusable_for_replay(ex)
        if err is not None:
            if not skip_unusable:
                raise err
            if skipped is not None:
                skipped.append((ex.source, err.kind, err.what))
            continue
        vendor = _dir_name(ex.served_model or ex.model)
        tokens = cfg.tokens if cfg.tokens != "auto" else (RETURNED if ex.output_token_ids is not None else DERIVED)
        if tokens == RETURNED and ex.output_token_ids is None:
            raise VerinferError("the log holds no token ids for this exchange (--tokens returned)", where=ex.source,
                                fix="derive them from the text (--tokens derived, the default)")
        n_out = len(ex.output_token_ids) if ex.output_token_ids is not None else (ex.usage or {}).get("completion_tokens")
        params = replace(cfg.params, max_tokens=max(1, int(ex.sampling.get("max_tokens") or n_out or cfg.max_tokens)))
        groups.setdefault(vendor, []).append(Claim.from_chat(
            ex.id, name, list(ex.messages), ex.text, ex.finish_reason, params, retok, tokens=tokens,
            returned=(None if ex.prompt_token_ids is None else list(ex.prompt_token_ids),
                      None if ex.output_token_ids is None else list(ex.output_token_ids)),
            usage=ex.usage, provider=vendor, extra={"source": ex.source}))
    if not groups:
        raise VerinferError("the log holds no exchange that can be audited", where=str(log),
                            fix="see the skipped exchanges above; greedy chat exchanges with text replies are audited")
    return groups


def _dir_name(model: str) -> str:
    """A vendor name usable as a directory: the model name with other characters as '_'."""
    out = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in model).strip("._") or "model"
    return out[:64]


def audit_log(log: Path, cfg: ChatAuditConfig, *, skip_unusable: bool = False,
              show_progress: bool = True) -> ChatAuditResult:
    """Audit a log of chat exchanges: a row per model the replies name, judged like a vendor; the
    honest calibration and the reference bands run locally on the log's own conversations (each
    with the reply's length as max_tokens). Skipped exchanges are counted in vendors.json."""
    t0 = time.perf_counter()
    check_writable(cfg.out_dir, "audit directory", directory=True)
    retok = Retokenizer.for_model(cfg.model_dir)
    skipped: list = []
    groups = log_claims(log, cfg, retok, skip_unusable=skip_unusable, skipped=skipped)
    every = [c for cs in groups.values() for c in cs]
    conv = [c.chat["messages"] for c in every]
    lengths = [c.sampling.max_tokens for c in every]
    audit = ChatAudit(cfg, show_progress, conversations=conv, max_tokens=lengths)
    audit.calibration = (conv[: cfg.calib_n], lengths[: cfg.calib_n])
    det = audit.detector()
    bands = audit.bands(det)
    rows = []
    for vendor, claims in groups.items():
        out = audit.out / "vendors" / vendor
        out.mkdir(parents=True, exist_ok=True)
        path = out / "claims.jsonl"
        with exclusive_lock(path):
            if not path.is_file() or path.read_text() != claims_text(claims):
                write_claims(path, claims)
            rows.append(audit.judge(VendorResult(vendor, str(log), vendor), claims, len(claims), out, det, bands))
    audit.timings["total_s"] = time.perf_counter() - t0
    return _write_results(audit, det, bands, rows, f"verinfer audit of the chat log {Path(log).name}",
                          {"log": str(log), "exchanges": len(every), "skipped": [list(s) for s in skipped]})


def _heldout(det) -> dict | None:
    cal = getattr(det, "calibration_", None)
    held = cal and cal.heldout
    return None if not held else {"fpr": held.fpr, "batches": held.batches, "batch_tokens": held.batch_tokens}


__all__ = ["BANDS", "ChatAuditConfig", "ChatAuditResult", "VendorResult", "audit_endpoint", "audit_log",
           "audit_vendors", "collect_vendor", "log_claims", "read_vendors"]
