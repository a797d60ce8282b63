"""The options of every `verinfer` command: value sets, help texts and defaults, one constant per
option (commands in cli/main.py take them as parameter defaults, so each command stays a few lines).

The fixed value sets are choices read from the library's own lists (`Names`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

import typer



class Names:
    """A choice whose names come from the library's own list (a `verinfer.registry.Registry` or a
    tuple), read when first needed: `verinfer --help` imports no torch, and no list is copied here.
    `renamed` (old name -> new name): old names still accepted, not listed in help."""

    def __init__(self, load: Callable[[], Iterable[str]], renamed: Callable[[], dict] = dict):
        self._load, self._names, self.case_sensitive = load, None, True
        self._load_renamed, self._renamed = renamed, None

    @property
    def choices(self) -> tuple[str, ...]:
        if self._names is None:
            self._names = tuple(self._load())
        return self._names

    @property
    def renamed(self) -> dict[str, str]:
        if self._renamed is None:
            self._renamed = {k: v for k, v in self._load_renamed().items() if v in self.choices}
        return self._renamed


def _noise_names():
    from verinfer.sampling.noise import NOISE_BACKENDS
    from verinfer.speculative.spec_claims import SPEC_NOISE

    return [n for n in NOISE_BACKENDS.names() if n != SPEC_NOISE]  # the speculative decoder's own stream


def _names(module: str, attr: str, renamed: tuple[str, str] | None = None) -> Names:
    """Names(module.attr): a Registry's names, or a tuple / dict's keys; `renamed`: (module, attr)
    of the {old name: new name} dict of its renamed entries."""
    import importlib

    def load():
        obj = getattr(importlib.import_module(module), attr)
        return obj.names() if hasattr(obj, "names") else list(obj)

    def load_renamed():
        return dict(getattr(importlib.import_module(renamed[0]), renamed[1])) if renamed else {}
    return Names(load, load_renamed)


# The value sets of the options (help lists them; another value is a usage error, exit 2): each
# parameter is annotated `str` and `choices_of` gives its click type by (command, parameter).
NOISE = Names(_noise_names)
MATMUL = _names("verinfer.numerics.config", "VERIFIER_MATMULS")
POLICY = _names("verinfer.determinism.scheduler", "POLICIES", renamed=("verinfer.determinism.scheduler", "RENAMED"))
SPEC_RULE = _names("verinfer.speculative.rules", "RELAX")
ENGINES = _names("verinfer.apps.generate", "ENGINES")
AUDIT_MODES = _names("verinfer.core.completions", "MODES")
MISCONFIGS = _names("verinfer.providers.simulated", "MISCONFIGURED")
SCORE_NAMES = _names("verinfer.scores", "ALL_SCORES")
SERVE_DETERMINISTIC_NAMES = _names("verinfer.server.registry", "DETERMINISTIC")
SERVE_BATCHING_NAMES = _names("verinfer.server.batching", "BATCHING")
TESTBED_BUDGETS = _names("verinfer.models.testbed", "BUDGETS")
DRAFT_BUDGETS = _names("verinfer.models.draft", "BUDGETS")
HEAD_BUDGETS = _names("verinfer.speculative.head_build", "BUDGETS")
DETECTOR_NAMES = _names("verinfer.detect.registry", "DETECTORS")
TOKEN_MODES = _names("verinfer.core.chat", "TOKEN_MODES")
BAND_NAMES = _names("verinfer.core.local_runs", "CHAT_BANDS")
HONEST_NAMES = _names("verinfer.providers.simulated", "HONEST")
LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]   # uvicorn's levels (not ours)
CHOICES = {("*", "noise"): NOISE, ("*", "matmul"): MATMUL, ("generate", "deterministic"): POLICY,
           ("generate", "speculative"): SPEC_RULE, ("generate", "engine"): ENGINES, ("audit-api", "mode"): AUDIT_MODES,
           ("audit-vendors", "mode"): _names("verinfer.core.chat", "CHAT_MODES"),
           ("serve", "misconfig"): MISCONFIGS, ("serve", "deterministic"): SERVE_DETERMINISTIC_NAMES,
           ("serve", "batching"): SERVE_BATCHING_NAMES,
           ("calibrate", "score_name"): SCORE_NAMES, ("calibrate", "kind"): DETECTOR_NAMES,
           ("build", "budget"): TESTBED_BUDGETS, ("build-draft", "budget"): DRAFT_BUDGETS,
           ("build-head", "budget"): HEAD_BUDGETS,
           ("*", "tokens"): TOKEN_MODES, ("*", "bands"): BAND_NAMES,
           ("*", "band_engine"): _names("verinfer.core.chat", "BAND_ENGINES"),
           ("*", "unseeded_detector"): _names("verinfer.core.chat", "UNSEEDED_DETECTORS"),
           ("score", "reference_protocol"): _names("verinfer.audit.remote_reference", "PROTOCOLS"),
           ("calibrate", "policy"): _names("verinfer.determinism.tau", "GATED",
                                           renamed=("verinfer.determinism.scheduler", "RENAMED"))}


def choices_of(command: str | None, param: str) -> Names | None:
    """The choice type of `param` of `command` (None: a free value)."""
    return CHOICES.get((command, param)) or CHOICES.get(("*", param))

MATMUL_HELP = ("Verifier matmuls: native (bf16 kernels) or fp32 (bf16 operands, fp32 GEMMs, outputs rounded to "
               "bf16). Which is faster depends on the CPU: time both (docs/vllm.md).")
DEVICE_HELP = "torch device: cpu, cuda, cuda:1, ..."
SEED_HELP = "Seed of the prompts and the per-request sampling seeds."
MODEL_HELP = "Model directory, or a model name from `verinfer models list` (fetched with `verinfer models get`)"
MODEL_DEFAULT_HELP = f"{MODEL_HELP} (default: testbed target)."
CACHE_HELP = "Cache directory (default: $VERINFER_CACHE, else ~/.cache/verinfer)."


def device():
    return typer.Option("cpu", help=DEVICE_HELP)


def seed():
    return typer.Option(0, help=SEED_HELP)


def model():
    return typer.Option(None, help=MODEL_DEFAULT_HELP)


def matmul():
    return typer.Option("native", help=MATMUL_HELP)


def noise(help: str):
    return typer.Option("vllm-cpu", help=help)


def model_names():
    return typer.Option(None, "--model-name", help="A name the claims use for this model (e.g. an endpoint's "
                                                   "--served-model-name), vouched for by you; repeatable. Names "
                                                   "the checkpoint records are accepted without it.")


def out(help: str, default=...):
    return typer.Option(default, "--out", "-o", help=help)


# -- demo -----------------------------------------------------------------------------------------
DEMO_OUT = typer.Option(Path("runs/demo"), help="Output directory (resumes a run made with the same model and "
                                                 "settings).")
DEMO_N = typer.Option(None, help="Requests per provider (half of each honest provider's tokens calibrate). Default "
                                 "128 on the testbed, 32 with --model (a real model decodes about 20x slower on a "
                                 "CPU).")
DEMO_MAX_TOKENS = typer.Option(64, help="Output tokens per request.")
DEMO_AUDIT_TOKENS = typer.Option(1000, help="Tokens per audited provider.")
QUIET = typer.Option(False, help="No progress bars.")

# -- generate -------------------------------------------------------------------------------------
PROVIDER_ARG = typer.Argument("honest-bf16-b8", help="Simulated provider, e.g. honest-bf16-b8, int4, fp8-kv, "
                                                     "temp-1.1, wrong-seed, sampling-bug.")
GEN_N = typer.Option(32, help="Number of requests.")
GEN_MAX_TOKENS = typer.Option(64, help="Output tokens per request (at most).")
TEMPERATURE = typer.Option(1.0, help="Advertised sampling temperature (0: greedy).")
TOP_K = typer.Option(50, help="Advertised top-k (<= 0: off).")
TOP_P = typer.Option(0.95, help="Advertised top-p (1: off).")
MIN_P = typer.Option(0.0, help="Advertised min-p (0: off).")
GEN_NOISE_HELP = "Noise backend the sampler draws from (claims name it)."
DETERMINISTIC = typer.Option(None, help="Greedy batched decoding equal to the batch-size-1 answer with this policy "
                                        "(ignores the provider).")
TAU_FILE = typer.Option(Path("runs/margingate_tau.json"), help="From `determinism calibrate`.")
FINGERPRINT = typer.Option(None, help="Attach Activation-DiFR fingerprints: k=16,stride=4[,layer=-1,seed=0,"
                                      "dtype=fp16|int8]")
SPECULATIVE = typer.Option(None, help="Speculative decoding with this acceptance rule (ignores the provider). Claims "
                                      "carry a `spec` field; filters off, temperature only.")
THRESHOLD = typer.Option(0.5, help="Threshold of the speculative rule (kl: KL nats).")
GAMMA = typer.Option(4, help="Draft tokens per speculative round.")
DRAFT_CONFIDENCE = typer.Option(0.0, help="Dynamic draft length: a round's block ends after a token the draft gave "
                                          "probability below this (0: gamma tokens; 0.4 is transformers' default).")
DRAFT = typer.Option(None, help="Draft model directory, or a feature-level head's (`models build-head`; default: testbed draft).")
JUDGE = typer.Option(None, help="Judge JSON for --speculative autojudge.")
ENGINE = typer.Option("verinfer", help="verinfer (simulated providers) or vllm (real vLLM; provider honest | int4 | "
                                       "fp8-kv | temp-1.1 | wrong-seed)")
UNSEEDED = typer.Option(False, "--unseeded", help="Write the sampled claims without seeds (\"seed\": null): honest "
                                                  "runs to calibrate an unseeded detector (pit-uniformity) on.")

# -- score ----------------------------------------------------------------------------------------
CLAIMS_ARG = typer.Argument(..., help="Claims JSONL.")
SCORE_DRAFT = typer.Option(None, help="Draft model (or feature-level head) directory for speculative claims (default: testbed draft).")
GAPS = typer.Option(False, "--gaps", help="Also the signed-gap columns the glrt detector reads.")
WORKERS = typer.Option(None, min=1, help="Score the parts on a local Ray pool of this many replay workers (needs the "
                                         "ray extra); bitwise the single-process result at --worker-threads.")
RAY_ADDRESS = typer.Option(None, help="Join this Ray cluster (ray start --head prints it) instead of starting one; "
                                      "the model directory must exist at the same path on every node.")
WORKER_THREADS = typer.Option(1, min=1, help="Torch threads per Ray worker (workers x threads <= cores, or they "
                                             "oversubscribe the CPU).")
REFERENCE_URL = typer.Option(None, help="Score from a trusted vLLM server's prompt logprobs instead of a local replay "
                                        "(OpenAI-compatible base URL ending in /v1); --model then needs only the "
                                        "model's config.json.")
REFERENCE_MODEL = typer.Option(None, help="The model name the reference server serves.")
REFERENCE_LOGPROBS = typer.Option(20, min=1, help="Prompt logprobs per position (the server's --max-logprobs at least "
                                                  "this); rows are exact where the claim's top-k is below it.")
REFERENCE_CONCURRENCY = typer.Option(4, min=1, help="Requests in flight to the reference server.")
REFERENCE_PROTOCOL = typer.Option("prompt_logprobs", help="How the reference server returns logprobs: vLLM's "
                                                          "prompt_logprobs, or echo (a hosted completions API's echo "
                                                          "with logprobs, top-k capped; rows beyond it marked "
                                                          "approximate).")

# -- calibrate ------------------------------------------------------------------------------------
HONEST_SCORES_ARG = typer.Argument(..., help="Scores Parquet files of honest runs.")
SCORE_NAME = typer.Option(None, "--score", help="clipped-mean: the per-token score column to average (default "
                                                "margin; fp_l2 for Activation-DiFR fingerprints).")
CLIP_QUANTILE = typer.Option(None, help="clipped-mean: honest quantile to clip at (default 0.999).")
TARGET_FPR = typer.Option(0.01, help="False-positive rate the threshold is set at, on honest batches.")
CALIBRATE_SEED = typer.Option(0, help="Seed of the null's resampling and of the held-out folds of claims.")
FPR_BATCH_TOKENS = typer.Option(250, min=1, help="Tokens per held-out batch of the held-out FPR (5 folds of each "
                                                 "honest file's claims, each audited by a detector fit on the other "
                                                 "four).")
DETECTOR_KIND = typer.Option("clipped-mean", "--detector",
                             help="clipped-mean | greedy | glrt | likelihood-ratio | xent-excess | pit-uniformity "
                                  "(detect.DETECTORS): clipped-mean "
                                  "(one --score column), greedy (temperature-0 claims: each mismatch counted, plus its "
                                  "margin up to where honest near-ties end), glrt (perturbation GLRT, the detection "
                                  "lab's `best`; needs scores from `verinfer score --gaps`), xent-excess and "
                                  "pit-uniformity (unseeded claims, `\"seed\": null`: the mean cross-entropy excess; "
                                  "Neyman's smooth test of the PIT values)")

# -- audit ----------------------------------------------------------------------------------------
AUDIT_INPUTS_ARG = typer.Argument(..., help="Scores Parquet or claims JSONL files.")
DETECTORS = typer.Option(..., "--detector", "-d", help="Detector JSON; repeat to combine (e.g. Token-DiFR margin and "
                                                       "Activation-DiFR fp_l2, from `calibrate --score fp_l2`).")
AUDIT_MODEL = typer.Option(None, help=f"For claims inputs: {MODEL_HELP} (default: testbed target).")
JSON_OUT = typer.Option(None, "--json", help="Also write verdicts as JSON.")
AUDIT_MAX_TOKENS = typer.Option(None, help="Use at most this many tokens per provider.")
AUDIT_PROVIDER = typer.Option(None, help="Provider of claims that name none (default: each file's stem).")
MERGE = typer.Option(False, help="Pool a provider found in several files into one row (default: one row per file).")
ALLOW_UNRECORDED_PROVENANCE = typer.Option(False, help="Audit scores or a detector that record no provenance "
                                                      "(refused otherwise: the model and settings cannot be "
                                                      "checked); every verdict then says 'provenance: unchecked'.")
ALLOW_UNRECORDED_CALIBRATION = typer.Option(False, help="Audit with a detector that records no calibration (refused "
                                                        "otherwise: its settings and fitted values cannot be checked "
                                                        "against what calibration produced); every verdict then says "
                                                        "'calibration: unchecked'.")
SEQUENTIAL = typer.Option(False, help="Anytime-valid audit (glrt detector): read each provider's tokens in order and "
                                      "flag once the e-value reaches 1/FPR; reports the tokens at which it decided.")

# -- report ---------------------------------------------------------------------------------------
REPORT_SCORES_ARG = typer.Argument(..., help="Scores Parquet files (`verinfer score`).")
REPORT_HONEST = typer.Option(None, help="Honest provider names (default: names starting 'honest').")
REPORT_MODEL = typer.Option(None, help=f"{MODEL_HELP}: the model the scores were replayed with, named in the report "
                                       "with its weights hash (scores files do not record it: without this the "
                                       "report says 'not recorded').")

# -- serve ----------------------------------------------------------------------------------------
SERVE_MODEL = typer.Option(None, help="A model directory, a directory of model directories, or a name from `verinfer "
                                      "models list` (default: testbed target). Requests name models; names never "
                                      "become paths.")
HOST = typer.Option("127.0.0.1", help="Address to listen on (127.0.0.1: this machine only).")
PORT = typer.Option(8000, help="TCP port to listen on.")
MISCONFIG = typer.Option(None, help="Serve a misconfigured model to test audits.")
SERVE_NOISE_HELP = "Noise backend of the sampler."
THREADS = typer.Option(None, help="torch threads (default: torch's choice).")
MAX_CONCURRENT = typer.Option(2, help="Generations running at once.")
MAX_WAITING = typer.Option(64, help="Queued generations before HTTP 503.")
SERVE_MAX_TOKENS = typer.Option(1024, help="Largest max_tokens a request may ask for.")
MAX_BODY_BYTES = typer.Option(1 << 20, help="Largest request body (bytes) before HTTP 413.")
LOG_LEVEL = typer.Option("info", help="uvicorn's log level.")
SERVE_DETERMINISTIC = typer.Option(None, help="Greedy tokens equal `verinfer generate --deterministic best` in any "
                                              "batch. best: decode on the fixed-shape deterministic path. margingate "
                                              "(needs --batching continuous and a calibrated tau, --tau-file): decode "
                                              "the batch in bf16, verify and repair only near-tie steps on that path.")
SERVE_TAU_FILE = typer.Option(Path("runs/margingate_tau.json"), help="With --deterministic margingate: the tau file "
                                                                     "of `determinism calibrate` (the served model's "
                                                                     "tau).")
BATCHING = typer.Option("alone", help="alone: every request decoded alone (batch of one). continuous: each model's "
                                      "greedy requests share one running batch (chunked prefill, joined between "
                                      "decode steps; bf16 tokens then depend on the batch); sampled ones run alone.")
MAX_BATCH = typer.Option(16, help="Rows of a model's running batch with --batching continuous (those rows take no "
                                  "--max-concurrent slot).")

# -- audit-api ------------------------------------------------------------------------------------
BASE_URL = typer.Option(..., help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
ENDPOINT_MODEL = typer.Option(..., help="The model name the endpoint serves.")
MODEL_DIR = typer.Option(None, help="Trusted local copy of that model: a directory or a name from `verinfer models "
                                    "list` (default: testbed target).")
API_OUT = typer.Option(Path("runs/audit-api"), "--out", "-o", help="Output directory (resumes).")
API_N = typer.Option(32, help="Prompts to send.")
API_MAX_TOKENS = typer.Option(64, help="max_tokens of each request.")
MODE = typer.Option("auto", help="seeded: temperature > 0 with per-request seeds; greedy: temperature 0 (endpoints "
                                 "that ignore seeds); auto: send one seeded prompt twice and pick.")
API_TEMPERATURE = typer.Option(None, help="Sampling temperature of seeded requests (default 1.0; with --chat 0, "
                                          "greedy: a chat audit above 0 sends per-request seeds).")
API_NOISE_HELP = "Noise backend the endpoint samples with (vllm-cpu for vLLM on CPU and verinfer serve)."
API_TOP_K = typer.Option(None, help="top_k of seeded requests (<= 0: off; default 50, with --chat off).")
API_TOP_P = typer.Option(None, help="top_p of seeded requests (1: off; default 0.95, with --chat 1).")
API_MIN_P = typer.Option(0.0, help="min_p of seeded requests (0: off).")
IGNORE_EOS = typer.Option(False, help="Send vLLM's ignore_eos (fixed-length outputs).")
API_KEY = typer.Option("EMPTY", envvar="OPENAI_API_KEY", help="API key sent to the endpoint.")
TIMEOUT = typer.Option(120.0, help="Seconds to wait for each reply.")
CALIB_N = typer.Option(None, help="Prompts per honest calibration run (default: the larger of --n and 64).")
API_HONEST = typer.Option(None, help="Honest configurations to calibrate on (default: all).")
API_DETECTOR = typer.Option(None, help="Calibrated detector to reuse (created if missing).")
AUDITOR_THREADS = typer.Option(None, help="torch threads of the auditor.")
API_SEQUENTIAL = typer.Option(False, help="Anytime-valid audit (glrt detector, seeded mode): replay each answer as it "
                                          "arrives and stop sending requests once the e-value reaches 1/FPR.")

# -- chat endpoints (audit-api --chat, audit-vendors, audit-log) ----------------------------------
CHAT = typer.Option(False, help="Audit a chat endpoint (/v1/chat/completions, text replies) at temperature 0, or "
                                "seeded at --temperature > 0: messages out, text back, token ids derived from the "
                                "text with the model's chat template and tokenizer.")
VENDORS_FILE = typer.Argument(..., help="TOML file, one [[vendor]] table per endpoint: name, base_url, model, "
                                        "optional api_key_env, concurrency, extra, and the sampling it is audited "
                                        "at: temperature, top_p, top_k, min_p, noise, mode.")
CHAT_TEMPERATURE = typer.Option(0.0, help="Temperature of every request (0: greedy; above 0 each request carries "
                                          "its own seed and the vendor is probed for seeds, --mode).")
CHAT_TOP_P = typer.Option(1.0, help="top_p of sampled requests (1: off).")
CHAT_TOP_K = typer.Option(-1, help="top_k of sampled requests (<= 0: off).")
CHAT_MIN_P = typer.Option(0.0, help="min_p of sampled requests (0: off).")
CHAT_NOISE_HELP = ("Noise backend the vendors sample with: with --mode seeded the one replayed, with auto the "
                   "probe's first candidate (vllm-cpu for vLLM on CPU and verinfer serve).")
CHAT_MODE = typer.Option("auto", help="Sampled audits: auto (send one seeded request twice and once with another "
                                      "seed: seeds honoured -> seeded with the sampler that reproduces the reply, "
                                      "else unseeded: judged by --unseeded-detector), seeded (trust --noise), greedy "
                                      "(temperature 0).")
UNSEEDED_DETECTOR = typer.Option("pit-uniformity", help="Detector of unseeded vendors and exchanges (sampled, no "
                                                        "usable seed), calibrated on verinfer's honest sampled runs "
                                                        "at their sampling: pit-uniformity (the PIT's shape; catches "
                                                        "a temperature-tuned substitute) or xent-excess (the mean "
                                                        "cross-entropy excess).")
LOG_NOISE = typer.Option(None, "--noise", help="Noise backend the log's seeded exchanges were sampled with (a log "
                                               "cannot be probed); sampled exchanges without a seed or a declared "
                                               "sampler are judged unseeded (--unseeded-detector).")
LOG_VENDORS = typer.Option(None, "--vendors", help="Vendors TOML file whose `noise` declares a vendor's sampler "
                                                   "(matched by its `model` or `name` to the names the log's replies "
                                                   "give), beside --noise for the others.")
CHAT_OUT = typer.Option(Path("runs/audit-chat"), "--out", "-o", help="Output directory (resumes per vendor).")
CHAT_N = typer.Option(64, help="Prompts per vendor (the most requests each is sent).")
SYSTEM_PROMPT = typer.Option(None, help="System message sent with every prompt (default: none, so the endpoint's "
                                        "template applies its own default).")
TOKENS = typer.Option("derived", help="Claim token ids: derived from the text (default), returned by the endpoint "
                                      "(vLLM's return_token_ids), or auto (returned where sent).",
                      )
CHAT_CALIB_N = typer.Option(64, help="Prompts per honest calibration run and per reference band.")
CHAT_HONEST = typer.Option(None, help="Honest configurations to calibrate on (default: all).")
BANDS = typer.Option(None, help="Reference bands to run (default: all).")
BAND_ENGINE = typer.Option("verinfer", help="Who runs the reference bands: verinfer's engine, or local vLLM (the "
                                            "[vllm] extra), as the DiFR authors did.")
CHAT_SEQUENTIAL = typer.Option(True, help="Stop a vendor's requests as soon as it is flagged (anytime-valid "
                                          "e-process over claims).")
TARGET_FPR_CHAT = typer.Option(0.01, help="False-positive rate of each verdict.")
API_KEY_ENV = typer.Option(None, help="Environment variable holding the endpoint's API key (read from the "
                                      "environment only; never written). Default: OPENAI_API_KEY when set.")
EXTRA = typer.Option(None, help='Extra request fields as JSON, passed through (e.g. \'{"provider": {"order": '
                                '["x"]}}\' to pin a router\'s provider).')
CONCURRENCY = typer.Option(4, help="Requests in flight per vendor.")
LOG_FILE = typer.Argument(..., help="JSONL log of chat exchanges: one {\"request\": ..., \"response\": ...} "
                                    "per line (OpenAI chat-completions JSON).")
SKIP_UNUSABLE = typer.Option(False, help="Skip exchanges that cannot be audited (tool calls, images, n > 1, ...) "
                                         "and count them, instead of stopping at the first.")
NEUTRAL_FIELD = typer.Option([], "--neutral-field", metavar="FIELD",
                             help="A request field of the log's (a gateway's or vendor's own) that changes no token, "
                                  "so exchanges carrying it are audited (repeatable; fields the chat contract does "
                                  "not know are refused otherwise).")

# -- determinism, models, testbed, speculative ----------------------------------------------------
TAU_OUT = typer.Option(Path("runs/margingate_tau.json"), "--out", "-o", help="Tau JSON to write (merged by model; "
                                                                             "read by `generate --deterministic "
                                                                             "margingate`).")
TAU_N = typer.Option(16, help="Calibration (arithmetic) prompts.")
TAU_POLICY = typer.Option("margingate", help="The gated policy to calibrate: margingate (the paper's: its verifier "
                                             "reads only the request's token prefix) or its margingate_live_cache "
                                             "ablation (its verifier reads the live cache).")
MAX_BATCH = typer.Option(16, help="Largest decode batch.")
TAU_SEED = typer.Option(0, help="Seed of the calibration prompts.")
MODEL_NAME_ARG = typer.Argument(..., help="A name from `verinfer models list`, e.g. smollm2-135m-instruct.")
BUILD_SEED = typer.Option(0, help="Seed of the corpus, initialization and training.")
TESTBED_OUT = typer.Option(None, help="Output directory (default: the shipped testbed directory).")
TESTBED_BUDGET = typer.Option("full", help="full: the shipped models; tiny: a seconds-long smoke build.")
DRAFT_TARGET = typer.Option(..., help="The target: a catalog name (e.g. smollm2-135m-instruct) or a model directory.")
DRAFT_SEED = typer.Option(0, help="Seed of the data order, initialization and training.")
DRAFT_OUT = typer.Option(None, help="Output directory (default: the shipped models/drafts/<target>-draft).")
DRAFT_BUDGET = typer.Option("full", help="full: the shipped draft (786k teacher tokens, 2 epochs); large: 2.1M "
                                         "tokens, 3 epochs (reuses full's teacher shards); tiny: a seconds-long smoke "
                                         "build.")
DRAFT_WORK = typer.Option(None, help="Teacher shards and checkpoints (default: <cache>/work/<target>-draft-seed<seed>/"
                                     "<budget>); a rerun resumes from them.")
HEAD_OUT = typer.Option(None, help="Output directory (default: the shipped models/drafts/<target>-head).")
HEAD_BUDGET = typer.Option("full", help="full: the shipped head (786k feature tokens, 2 epochs); tiny: a seconds-long "
                                        "smoke build.")
HEAD_WORK = typer.Option(None, help="Feature shards and checkpoints (default: <cache>/work/<target>-head-seed<seed>/"
                                    "<budget>); a rerun resumes from them.")
JUDGE_OUT = typer.Option(..., "--out", "-o", help="Judge JSON to write (read by `generate --speculative autojudge "
                                                  "--judge`).")
JUDGE_N = typer.Option(64, min=1, help="Arithmetic training problems to mine (never a held-out question).")
JUDGE_SEED = typer.Option(1, help="Seed of the training problems and of the logistic regression.")
JUDGE_MAX_TOKENS = typer.Option(8, min=1, help="Output tokens per problem (at most; a newline token stops).")
JUDGE_C = typer.Option(1.0, help="Inverse regularization strength of the logistic regression.")

# -- determinism probe ----------------------------------------------------------------------------
PROBE_OUT = typer.Option(Path("runs/determinism-probe"), "--out", "-o",
                         help="Output directory: probe.json, probe.md, probe.html.")
PROBE_N = typer.Option(16, help="Probe prompts (each sent alone twice and once per condition).")
PROBE_MAX_TOKENS = typer.Option(32, help="max_tokens of each probe request.")
PROBE_BATCH_SIZES = typer.Option("1,4,16", help="Requests in flight of the concurrent-B conditions, comma-separated.")
PROBE_MODEL_DIR = typer.Option(None, help="A local copy of the served model (directory or `verinfer models list` "
                                          "name): token-id prompts from verinfer's prompt sets for it (default: "
                                          "built-in text prompts).")
