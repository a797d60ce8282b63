"""DiFR detection study on the shipped testbed (issue 4): every score variant x misconfiguration x
batch size, the temperature-tuning attack, and a combined detector (`best`) that needs fewer
tokens than the 99.9-clipped Token-DiFR margin.

    .venv/bin/python -m benchmarks.detection_lab            # data (cached) + grid + report

Stages (each resumable; claims and per-token features cached under benchmarks/.cache/detection_lab/):
  data     generate claims for every configuration (the slow part, ~1400 tokens/s)
  features replay every claim set with the verifier and store per-token features (Parquet)
  references  replay every Gumbel claim set under the other honest reference kernels
           (`audit.references.REFERENCES`: fp32, bf16 eager, bf16 token-by-token decode one claim
           at a time and in random batches of 8) and store
           their signed gaps under features-<reference>/ (`best` takes the per-token envelope)
  grid     AUC@1%FPR per score x misconfiguration x batch size, tokens to detect, the attack
           table, the `best` detector and its held-out honest FPR, the feasibility ceilings; writes
           benchmarks/results/detection_lab.{json,md} and detection_lab_*.png
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.markdown import write_markdown
from verinfer.claims import read_claims, write_claims
from verinfer.apps.pipeline import DEFAULT_SPEC, prompts_for, verifier_engine
from verinfer.numerics import Numerics
from verinfer.providers.simulated import HONEST, MISCONFIGURED, ProviderConfig, run_provider
from verinfer.models.testbed import TARGET_DIR
from verinfer.sampling.params import SamplingParams

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "detection_lab"
RESULTS = ROOT / "results"
BATCH_SIZES = (1, 3, 10, 30, 100, 300, 1000, 3000, 10000)
MAX_TOKENS = 64
# Honest configurations kept OUT of detector calibration (a detector must hold its false-positive
# rate on honest set-ups it never saw). Not among the product's providers: the demo is unchanged.
HELDOUT_HONEST = {
    "heldout-bf16-b3": ProviderConfig("heldout-bf16-b3", Numerics(dtype="bf16"), batch_size=3,
                                      description="bf16, batches of 3 (held out of calibration)"),
    "heldout-bf16-t1-b12": ProviderConfig("heldout-bf16-t1-b12", Numerics(dtype="bf16", threads=1), batch_size=12,
                                          description="bf16, 1 thread, batches of 12 (held out)"),
    "heldout-fp32-eager-b6": ProviderConfig("heldout-fp32-eager-b6", Numerics(dtype="fp32", attn="eager"),
                                            batch_size=6, description="fp32, eager attention, batches of 6 (held out)"),
}
N_HONEST, N_MISCONF, N_HELDOUT, N_IPT = 320, 640, 320, 160  # N_IPT: ~10k tokens per inverse-CDF set (grid to 3000)
ATTACK_TEMPS = (0.95, 1.0, 1.025, 1.05, 1.075, 1.1)
N_ATTACK_PROBE = 96


def lab_configs() -> list[dict]:
    """Every claim set of the study: key, provider config, requests, base seed, noise backend, role."""
    out = []
    for i, (name, cfg) in enumerate(HONEST.items()):  # calibration pool: distinct prompts/seeds per config
        out.append(dict(key=name, cfg=cfg, n=N_HONEST, seed=10 + i, noise="vllm-cpu", role="honest"))
    for name, cfg in MISCONFIGURED.items():
        out.append(dict(key=name, cfg=cfg, n=N_MISCONF, seed=0, noise="vllm-cpu", role="misconf"))
    for i, (name, cfg) in enumerate(HELDOUT_HONEST.items()):
        out.append(dict(key=name, cfg=cfg, n=N_HELDOUT, seed=30 + i, noise="vllm-cpu", role="heldout"))
    # IPT-DiFR needs inverse-CDF sampling (one uniform per step): a smaller honest pool and grid
    for i, name in enumerate(("honest-bf16-b8", "honest-fp32-b4", "honest-bf16-eager-t1")):
        out.append(dict(key=f"icdf-{name}", cfg=HONEST[name], n=N_IPT, seed=20 + i, noise="inverse-cdf",
                        role="icdf-honest"))
    for name, cfg in MISCONFIGURED.items():
        out.append(dict(key=f"icdf-{name}", cfg=cfg, n=N_IPT, seed=0, noise="inverse-cdf", role="icdf-misconf"))
    return out


def claims_path(key: str) -> Path:
    return CACHE / "claims" / f"{key}.jsonl"


def ensure_claims(key: str, cfg: ProviderConfig, n: int, seed: int, noise: str, log=print):
    p = claims_path(key)
    if p.is_file():
        return read_claims(p)
    t0 = time.perf_counter()
    advertised = SamplingParams(seed=0, max_tokens=MAX_TOKENS, **{**DEFAULT_SPEC, "noise": noise})
    claims = run_provider(cfg, TARGET_DIR, prompts_for(TARGET_DIR, n, seed), advertised, base_seed=seed)
    claims = [replace(c, provider=key) for c in claims]
    write_claims(p, claims)
    tok = sum(len(c.output_token_ids) for c in claims)
    log(f"generated {key}: {tok} tokens in {time.perf_counter() - t0:.0f}s")
    return claims


def mean_cross_entropy(claims, engine) -> float:
    from verinfer.audit.replay import scores_table

    xs = []
    for s in range(0, len(claims), 64):
        chunk = claims[s : s + 64]
        t = scores_table(chunk, engine.replay([(c.prompt_token_ids, c.output_token_ids) for c in chunk]))
        x = t["cross_entropy"].to_numpy()
        xs.append(x[np.isfinite(x)])
    return float(np.concatenate(xs).mean())


def attack_temperature(engine, log=print) -> dict:
    """The temperature at which the int4 provider's mean verifier cross-entropy matches the honest
    mean: int4 probe runs at several temperatures on the SAME prompts and seeds as the first
    N_ATTACK_PROBE claims of honest-bf16-b8, linear interpolation of mean CE in temperature."""
    f = CACHE / "attack_temperature.json"
    if f.is_file():
        return json.loads(f.read_text())
    honest = ensure_claims("honest-bf16-b8", HONEST["honest-bf16-b8"], N_HONEST, 10, "vllm-cpu", log)
    ce_honest = mean_cross_entropy(honest[:N_ATTACK_PROBE], engine)
    probes = {}
    for t in ATTACK_TEMPS:
        cfg = replace(MISCONFIGURED["int4"], name=f"int4-T{t}", temperature=t)
        c = ensure_claims(f"probe-int4-T{t}", cfg, N_ATTACK_PROBE, 10, "vllm-cpu", log)
        probes[t] = mean_cross_entropy(c, engine)
    ts, ces = np.array(list(probes)), np.array(list(probes.values()))
    order = np.argsort(ces)
    t_star = float(np.interp(ce_honest, ces[order], ts[order]))
    out = {"honest_mean_cross_entropy_same_prompts": ce_honest,
           "probe_mean_cross_entropy": {str(k): v for k, v in probes.items()}, "temperature": round(t_star, 4),
           "inside_probe_range": bool(ces.min() <= ce_honest <= ces.max())}
    f.write_text(json.dumps(out, indent=1))
    log(f"attack temperature {t_star:.4f} (honest CE {ce_honest:.4f}, probes {probes})")
    return out


def stage_data(log=print, attack_first: bool = False) -> None:
    """Generate every claim set (skipping cached ones). attack_first: the attack, then the other
    sets in reverse order (a second worker meeting the first one in the middle)."""
    engine = verifier_engine(TARGET_DIR)

    def attack():
        at = attack_temperature(engine, log)
        cfg = replace(MISCONFIGURED["int4"], name="int4-tuned", temperature=at["temperature"])
        ensure_claims("int4-tuned", cfg, N_HONEST, 0, "vllm-cpu", log)

    configs = lab_configs()
    if attack_first:
        attack()
        configs = configs[::-1]
    for c in configs:
        ensure_claims(c["key"], c["cfg"], c["n"], c["seed"], c["noise"], log)
    attack()


# --- features: one verifier replay per claim set -----------------------------------------------------
def features_path(key: str) -> Path:
    return CACHE / "features" / f"{key}.parquet"


def stage_features(log=print, reverse: bool = False) -> None:
    import pyarrow as pa

    import pyarrow.parquet as pq

    from verinfer.io import atomic_write
    from benchmarks.difr_variants import features_table

    engine = verifier_engine(TARGET_DIR)
    keys = [c["key"] for c in lab_configs()] + ["int4-tuned"]
    for key in keys[::-1] if reverse else keys:
        out = features_path(key)
        if out.is_file():
            continue
        if not claims_path(key).is_file():
            log(f"skip {key}: no claims yet (run --stage data)")
            continue
        t0 = time.perf_counter()
        claims = read_claims(claims_path(key))
        parts = []
        for s in range(0, len(claims), 64):
            chunk = claims[s : s + 64]
            parts.append(features_table(chunk, engine.replay([(c.prompt_token_ids, c.output_token_ids) for c in chunk]),
                                        temperature_factors=TEMPERATURE_FACTORS, top_p_slacks=TOP_P_SLACKS))
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, lambda tmp: pq.write_table(pa.concat_tables(parts), tmp))
        log(f"features {key}: {sum(p.num_rows for p in parts)} tokens in {time.perf_counter() - t0:.0f}s")


def reference_features_path(ref: str, key: str) -> Path:
    return CACHE / f"features-{ref}" / f"{key}.parquet"


def reference_columns() -> list[str]:
    """The signed-gap columns a reference replay keeps (those `best` reads)."""
    from verinfer.scores import gap_column, temperature_column

    cols = [gap_column(), *(temperature_column(r) for r in TEMPERATURE_FACTORS)]
    for tau in TOP_P_SLACKS:
        cols += [gap_column(tau), *(temperature_column(r, tau) for r in TEMPERATURE_FACTORS)]
    return cols


def stage_references(log=print, reverse: bool = False) -> None:
    """Replay every Gumbel claim set under each extra honest reference (`references.REFERENCES`
    other than the primary bf16 replay) and keep the signed-gap
    columns (`best` takes their per-token envelope)."""
    import pyarrow as pa

    from verinfer.audit.references import REFERENCES, replay
    import pyarrow.parquet as pq

    from verinfer.io import atomic_write
    from benchmarks.difr_variants import features_table

    keys = [c["key"] for c in lab_configs() if c["noise"] == "vllm-cpu"] + ["int4-tuned"]
    keep = ["claim_id", "position", "token_id", *reference_columns()]
    for ref, reference in list(REFERENCES.items())[::-1] if reverse else REFERENCES.items():
        if ref == PRIMARY_REFERENCE:
            continue
        engine = None
        for key in keys[::-1] if reverse else keys:
            out = reference_features_path(ref, key)
            if out.is_file() or not claims_path(key).is_file():
                continue
            engine = engine or verifier_engine(TARGET_DIR, reference.numerics)
            t0 = time.perf_counter()
            claims = read_claims(claims_path(key))
            parts = []
            for s in range(0, len(claims), 64):
                chunk = claims[s : s + 64]
                t = features_table(chunk, replay(reference, engine, chunk), temperature_factors=TEMPERATURE_FACTORS,
                                   top_p_slacks=TOP_P_SLACKS)
                parts.append(t.select(keep))
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(out, lambda tmp: pq.write_table(pa.concat_tables(parts), tmp))
            log(f"reference {ref} {key}: {sum(p.num_rows for p in parts)} tokens in {time.perf_counter() - t0:.0f}s")


PRIMARY_REFERENCE = "bf16"  # the verifier's replay in features/ (VERIFIER_NUMERICS)
TEMPERATURE_FACTORS = (0.8, 0.9, 1.1, 1.2)  # signed gaps at r x the claimed temperature (`best`'s temperature alternatives)
TOP_P_SLACKS = (0.01,)  # signed gaps with a tolerance at the top-p cut (variants.block_gaps)
# PerturbationGLRTDetector(**BEST_CONFIG). The envelope's honest fit is ~7x narrower in sigma0 and ~40x
# rarer in eps0 than one replay's (0.0020 vs 0.015, 4.6e-6 vs 1.9e-4), so the alternatives reach further
# in factors to span the same absolute range as the single-replay detector's (sigma to ~0.1 logit, eps to ~5e-3)
# (these are PerturbationGLRTDetector's defaults: `verinfer calibrate --detector glrt` fits this detector)
BEST_CONFIG = dict(temperature_factors=TEMPERATURE_FACTORS, sigma_factors=(1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0),
                   eps_factors=(10.0, 100.0, 1000.0), envelope=True)
# glrt_single_replay: the primary replay's gaps alone, with the alternatives that fit one replay's honest spread
SINGLE_CONFIG = dict(temperature_factors=TEMPERATURE_FACTORS, sigma_factors=(1.5, 2.0, 3.0, 5.0), eps_factors=(10.0, 100.0),
                     envelope=False)
BEST_DESCRIPTION = (
    "PerturbationGLRTDetector (src/verinfer/detect/glrt.py) on the honest-reference envelope "
    "(src/verinfer/audit/references.py): each claim is replayed by five honest kernels (bf16 teacher-forced, the "
    "primary replay; fp32; bf16 eager attention; bf16 token by token through the KV cache, as a provider decodes, one "
    "claim at a time and in padded batches of 8 randomly grouped claims) and per token the signed post-Gumbel gap d "
    "of the claimed token to its strongest competitor is the minimum over the five (the margin if no honest kernel reproduces the token, minus the runner-up gap of the best one if some "
    "does), with a tolerance of 0.01 at the top-p cut. Model: the provider's scores are the envelope's plus "
    "N(0, sigma^2) per logit, with a fraction eps of outlier tokens (1 of 50 candidates), at r x the claimed "
    "temperature; (sigma0, eps0) fitted by maximum likelihood on honest train tokens. Per-token log-likelihood ratios "
    "of the alternatives sigma0 x 1.5/2/3/5/10/20/50, eps0 x 10/100/1000 and temperature x 0.8/0.9/1.1/1.2 (noise "
    "columns centered "
    "by their expectation under the honest fit given the token's gap); batch statistic = the largest "
    "standardized excess sqrt(n) (column mean - allowance) / sd over the alternatives (max-z GLRT), the allowance "
    "being a per-token bound for a new honest configuration (the one-sided 99% prediction bound of its column "
    "means from the 5 honest calibration configurations); threshold from those configurations' resampled batches "
    "shifted to the allowance (constant in n, while a provider beyond the allowance scores ~sqrt(n) x its "
    "excess: evidence accumulates). "
    "Fit on honest tokens only; every reference is an honest kernel (none replays a misconfiguration).")


# --- grid -----------------------------------------------------------------------------------------------
CLIPS = {"margin_clip99": 0.99, "margin_clip99.9": 0.999, "margin_clip99.99": 0.9999, "margin_clip99.999": 0.99999}
FINE_SIZES = (1, 2, 3, 5, 10, 20, 30, 50, 100, 200, 300, 500, 1000, 2000, 3000, 5000, 10000)
N_BATCHES = 1000
MC_TRIALS = 100


def load_features(key: str) -> dict:
    import pyarrow.parquet as pq

    from benchmarks.difr_variants import gaps_of

    t = pq.read_table(features_path(key))
    d = {c: t[c].to_numpy(zero_copy_only=False) for c in ("margin", "exact_match", "cross_entropy",
                                                           "ipt_lo", "ipt_hi", "ipt_u")}
    d["exact_match"] = d["exact_match"].astype(bool)
    d["gaps"] = gaps_of(t)
    d["logit_gap"] = t["logit_gap"].to_numpy()
    d["gap_0"] = d["gaps"][:, 0]
    d.update({c: t[c].to_numpy() for c in t.column_names if c.startswith("gapT_") or c.startswith("gap_0_s")})
    add_envelope(d, key, t)
    return d


ENV = "env:"  # prefix of the envelope columns (min over the honest reference replays) in a features dict


def add_envelope(d: dict, key: str, primary) -> None:
    """d[ENV + c] = per-token envelope (`references.envelope`) of signed-gap column c over the
    primary replay and every extra reference replay, when all of them are cached."""
    import pyarrow.parquet as pq

    from verinfer.audit.references import REFERENCES, envelope_table

    paths = [reference_features_path(r, key) for r in REFERENCES if r != PRIMARY_REFERENCE]
    if not all(p.is_file() for p in paths):
        return
    cols = reference_columns()
    d.update({ENV + c: v for c, v in envelope_table([primary, *(pq.read_table(p) for p in paths)], cols).items()})


def env_view(d: dict, prefix: str = "env_") -> dict:
    """The envelope signed-gap columns of a features dict named as `verinfer score --gaps` names them
    (prefix "env_", `best`'s input), or under their plain names (prefix "")."""
    cols = reference_columns()
    if ENV + cols[0] not in d:
        raise KeyError("no envelope columns: run `--stage references` (honest reference replays) first")
    return {prefix + c: d[ENV + c] for c in cols}


def take(d: dict, idx) -> dict:
    return {k: v[idx] for k, v in d.items()}


def cat(ds: list[dict]) -> dict:
    return {k: np.concatenate([d[k] for d in ds]) for k in ds[0]}


class Scorer:
    """Per-token divergences of every score variant, with parameters fitted on honest train tokens
    only (clip percentiles, sigma, IPT kernel width)."""

    def __init__(self, honest_train: dict, ipt: bool = False):
        from verinfer.detect.clipping import clip_at_quantile
        from verinfer.detect.clipping import fit_sigma
        from benchmarks.difr_variants import fit_ipt_sigma

        h = honest_train
        self.ipt = ipt
        self.fit = {}
        if ipt:
            self.fit["ipt_sigma"] = fit_ipt_sigma(h["ipt_lo"], h["ipt_hi"], h["ipt_u"])
            self.names = ("ipt_difr", "exact_match", "cross_entropy")
        else:
            self.fit["sigma"] = fit_sigma(h["margin"])
            self.names = (*CLIPS, "likelihood", "exact_match", "cross_entropy", "mc_difr", "tail")
        raw = {n: self.raw(n, h) for n in self.names}
        self.clip = {}
        for n, v in raw.items():
            if n == "exact_match":
                continue
            q = CLIPS.get(n, 0.999)
            if n == "tail":
                self.clip[n] = (clip_at_quantile(v, 0.99999), clip_at_quantile(v, 0.9999))
            else:
                self.clip[n] = clip_at_quantile(v, q)

    def raw(self, name: str, d: dict) -> np.ndarray:
        from verinfer.scores import likelihood_score
        from benchmarks.difr_variants import ipt_difr, mc_difr

        if name in CLIPS or name == "tail":
            return d["margin"]
        if name == "likelihood":
            return -likelihood_score(d["margin"], self.fit["sigma"])
        if name == "exact_match":
            return 1.0 - d["exact_match"].astype(np.float64)
        if name == "cross_entropy":
            return d["cross_entropy"]
        if name == "mc_difr":
            return mc_difr(d["gaps"], self.fit["sigma"], MC_TRIALS, np.random.default_rng(7))
        if name == "ipt_difr":
            return ipt_difr(d["ipt_lo"], d["ipt_hi"], d["ipt_u"], self.fit["ipt_sigma"])
        raise ValueError(name)

    def values(self, name: str, d: dict) -> np.ndarray:
        from verinfer.detect.clipping import tail_pool, winsorize

        v = self.raw(name, d)
        if name == "exact_match":
            return v
        if name == "tail":
            return tail_pool(v, *self.clip[name])
        return winsorize(v, self.clip[name])


def auc_curve(h: np.ndarray, m: np.ndarray, sizes, seed: int) -> dict:
    from verinfer.detect.metrics import auc_at_fpr, batch_means

    rng = np.random.default_rng(seed)
    out = {}
    for b in sizes:
        if b > min(h.size, m.size):
            out[b] = None
            continue
        out[b] = auc_at_fpr(batch_means(h, b, N_BATCHES, rng), batch_means(m, b, N_BATCHES, rng), 0.01)
    return out


def best_curve(det, h: dict, m: dict, sizes, seed: int) -> dict:
    """auc_curve for the PerturbationGLRTDetector: its batch statistic (max-z over its per-token
    log-likelihood-ratio columns) on batches drawn with replacement from each test split."""
    from verinfer.detect.metrics import auc_at_fpr

    rng = np.random.default_rng(seed)
    hx, mx = det.token_columns(h), det.token_columns(m)
    out = {}
    for b in sizes:
        if b > min(len(hx), len(mx)):
            out[b] = None
            continue
        out[b] = auc_at_fpr(det.batch_statistics(hx, b, N_BATCHES, rng), det.batch_statistics(mx, b, N_BATCHES, rng), 0.01)
    return out


ORACLE_EDGES = np.array([-np.inf, -1, -0.3, -0.1, -0.05, -0.03, -0.02, -0.01, -0.005, 0, 0.0025, 0.005, 0.01, 0.02,
                         0.03, 0.05, 0.1, 0.2, 0.5, 1, 3, np.inf])


def gap_oracle_llr(h_gap: np.ndarray, m_gap: np.ndarray):
    """Per-token log-likelihood ratio of a binned signed gap (ORACLE_EDGES, +0.5 per bin) between a
    misconfiguration's and the honest pool's gap histograms: the Neyman-Pearson statistic of
    an oracle that KNOWS the misconfiguration's gap distribution (a ceiling, not a detector)."""
    def idx(g):
        g = np.where(np.isposinf(g), 1e9, g)
        return np.clip(np.searchsorted(ORACLE_EDGES, g, side="right") - 1, 0, len(ORACLE_EDGES) - 2)

    nb = len(ORACLE_EDGES) - 1
    ph = np.bincount(idx(h_gap), minlength=nb) + 0.5
    pm = np.bincount(idx(m_gap), minlength=nb) + 0.5
    llr = np.log(pm / pm.sum()) - np.log(ph / ph.sum())
    return lambda g: llr[idx(g)]


def feasibility(tr: dict, te: dict, honest: list, m: str) -> dict:
    """What any detector could reach for misconfiguration m from the claimed tokens, two ways.

    gap_oracle_auc: AUC@1%FPR of the summed per-token `gap_oracle_llr` of the envelope gap
    (fitted on m's own train half: knows the misconfiguration) on the test halves.

    agreement bound: a token carries evidence only if the misconfigured and the honest sampler
    would pick different tokens at its context and seed; rho = fraction of such tokens (int4,
    fp8-kv, wrong-seed, sampling-bug: not reproduced by any honest reference; temp-1.1: the
    replay's choice at the claimed temperature differs from its choice at 1.1 x, measured on m
    and on the honest pool); q(n) = (1 - rho)^n batches of n resampled tokens have none, and
    `metrics.auc_at_fpr_bound(q_m(n), q_honest=q_h(n))` bounds AUC@1%FPR (token-level model:
    a token without evidence is distributed as an honest one)."""
    from verinfer.detect.metrics import auc_at_fpr_bound

    col = "gap_0_s0.01"
    h_tr, h_te = cat([env_view(tr[k], "") for k in honest]), cat([env_view(te[k], "") for k in honest])
    f = gap_oracle_llr(h_tr[col], env_view(tr[m], "")[col])
    oracle = auc_curve(f(h_te[col]), f(env_view(te[m], "")[col]), BATCH_SIZES, seed=6)

    def rho(d: dict) -> float:
        e = env_view(d, "")
        if m.startswith("temp-"):
            alt = float(m.split("-", 1)[1])
            return float(np.mean((e["gap_0"] > 0) ^ (e[f"gapT_{alt:g}"] > 0)))
        return float(np.mean(e["gap_0"] > 0))

    rho_m = rho(cat([tr[m], te[m]]))
    rho_h = rho(cat([cat([tr[k], te[k]]) for k in honest]))
    bound = {str(n): auc_at_fpr_bound((1 - rho_m) ** n, 0.01, (1 - rho_h) ** n) for n in BATCH_SIZES}
    return {"gap_oracle_auc": {str(b): v for b, v in oracle.items()}, "rho": rho_m, "rho_honest": rho_h,
            "agreement_bound_auc": bound}


def heldout_fpr(det, sets: dict, sizes, seed: int = 3) -> dict:
    """Flag rate of a fitted detector on random batches of honest configurations it never saw."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, vals in sets.items():
        row = {}
        for b in sizes:
            thr = det.threshold(b)
            if hasattr(det, "batch_statistics"):
                stats = det.batch_statistics(det.token_columns(vals), b, 200, rng)
                row[b] = float(np.mean(stats > thr))
                continue
            w = det.token_scores(vals)
            means = w[rng.integers(0, w.size, (200, b))].mean(axis=1) if b <= 3000 else \
                np.array([w[rng.integers(0, w.size, b)].mean() for _ in range(200)])
            row[b] = float(np.mean(means > thr))
        out[key] = row
    return out


def stage_grid(log=print) -> dict:
    from verinfer.detect.clipped_mean import ClippedMeanDetector
    from verinfer.detect.glrt import PerturbationGLRTDetector
    from verinfer.detect.likelihood_ratio import LikelihoodRatioDetector
    from verinfer.detect.metrics import split_tokens, tokens_to_detect
    from verinfer.audit.references import REFERENCES

    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    configs = {c["key"]: c for c in lab_configs()}
    data = {k: load_features(k) for k in [*configs, "int4-tuned"] if features_path(k).is_file()}
    split = {k: split_tokens(len(d["margin"]), rng) for k, d in data.items()}
    tr = {k: take(d, split[k][0]) for k, d in data.items()}
    te = {k: take(d, split[k][1]) for k, d in data.items()}
    honest = [k for k, c in configs.items() if c["role"] == "honest" and k in data]
    misconf = [k for k, c in configs.items() if c["role"] == "misconf" and k in data]
    heldout = [k for k, c in configs.items() if c["role"] == "heldout" and k in data]
    h_tr, h_te = cat([tr[k] for k in honest]), cat([te[k] for k in honest])
    log(f"honest train {h_tr['margin'].size} / test {h_te['margin'].size} tokens; misconfigs {misconf}")

    sc = Scorer(h_tr)
    h_groups = np.concatenate([np.full(len(tr[k]["margin"]), k) for k in honest])
    # best: perturbation GLRT on the honest-reference envelope of the signed gaps, fit on honest train
    # tokens only, random-effects null over honest configs; glrt_single_replay: the same detector on
    # the primary bf16 replay's gaps alone (the previous `best`)
    best = PerturbationGLRTDetector(**BEST_CONFIG).fit(env_view(h_tr), groups=h_groups)
    single = PerturbationGLRTDetector(**SINGLE_CONFIG).fit(h_tr, groups=h_groups)
    log(f"best: sigma0 {best.sigma0_:.4g}, eps0 {best.eps0_:.3g}, tau/sd {np.round(best.tau_ / best.sd_, 4).tolist()}")
    ev = {k: env_view(d) for k, d in te.items() if ENV + reference_columns()[0] in d}
    h_ev = env_view(h_te)
    curves = {m: {} for m in misconf}
    fine = {m: {} for m in misconf}
    oracle, ceilings = {}, {}
    h_vals = {n: sc.values(n, h_te) for n in sc.names}
    for m in misconf:
        for n in sc.names:
            curves[m][n] = auc_curve(h_vals[n], sc.values(n, te[m]), BATCH_SIZES, seed=1)
        # lr_combined: binned likelihood ratio over (margin, direction, cross-entropy), honest train +
        # the OTHER misconfigurations' train halves (leave-one-misconfiguration-out)
        lrd = LikelihoodRatioDetector().fit(h_tr, alternatives=[tr[o] for o in misconf if o != m])
        curves[m]["lr_combined"] = auc_curve(lrd.token_scores(h_te), lrd.token_scores(te[m]), BATCH_SIZES, seed=1)
        curves[m]["glrt_single_replay"] = best_curve(single, h_te, te[m], BATCH_SIZES, seed=1)
        curves[m]["best"] = best_curve(best, h_ev, ev[m], BATCH_SIZES, seed=1)
        fine[m]["margin_clip99.9"] = auc_curve(h_vals["margin_clip99.9"], sc.values("margin_clip99.9", te[m]),
                                               FINE_SIZES, seed=2)
        fine[m]["lr_combined"] = auc_curve(lrd.token_scores(h_te), lrd.token_scores(te[m]), FINE_SIZES, seed=2)
        fine[m]["glrt_single_replay"] = best_curve(single, h_te, te[m], FINE_SIZES, seed=2)
        fine[m]["best"] = best_curve(best, h_ev, ev[m], FINE_SIZES, seed=2)
        # reference ceiling: an oracle that sees which tokens the replay does not reproduce and knows
        # which of those the misconfiguration caused (honest batches always score 0)
        oracle[m] = auc_curve(np.zeros(len(h_te["margin"])), (~te[m]["exact_match"]).astype(np.float64),
                              BATCH_SIZES, seed=5)
        ceilings[m] = feasibility(tr, te, honest, m)
        log(f"grid {m}: " + ", ".join(f"{n}={tokens_to_detect(c)}" for n, c in curves[m].items()))

    # IPT-DiFR grid on the inverse-CDF claim sets
    ipt_h = [k for k, c in configs.items() if c["role"] == "icdf-honest" and k in data]
    ipt_m = [k for k, c in configs.items() if c["role"] == "icdf-misconf" and k in data]
    ipt_curves = {}
    if ipt_h and ipt_m:
        ih_tr, ih_te = cat([tr[k] for k in ipt_h]), cat([te[k] for k in ipt_h])
        isc = Scorer(ih_tr, ipt=True)
        ih_vals = {n: isc.values(n, ih_te) for n in isc.names}
        for k in ipt_m:
            m = k.removeprefix("icdf-")
            ipt_curves[m] = {n: auc_curve(ih_vals[n], isc.values(n, te[k]), BATCH_SIZES, seed=1) for n in isc.names}
            log(f"ipt grid {m}: " + ", ".join(f"{n}={tokens_to_detect(c)}" for n, c in ipt_curves[m].items()))

    ttd = {}
    for n in [*sc.names, "lr_combined", "glrt_single_replay", "best"]:
        ttd[n] = {m: tokens_to_detect(curves[m][n]) for m in misconf}
    ttd["ipt_difr"] = {m: tokens_to_detect(ipt_curves[m]["ipt_difr"]) if m in ipt_curves else None for m in misconf}
    ttd_fine = {n: {m: tokens_to_detect(fine[m][n]) for m in misconf}
                for n in ("margin_clip99.9", "lr_combined", "glrt_single_replay", "best")}

    # held-out honest configurations (never used in any fit): flag rates at a 1% target
    det_all = LikelihoodRatioDetector().fit(h_tr, alternatives=[tr[m] for m in misconf])
    RESULTS.mkdir(parents=True, exist_ok=True)
    det_all.save(RESULTS / "detection_lab_lr_detector.json")
    fpr_sizes = (10, 30, 100, 300, 1000, 3000, 10000)
    ho = {k: data[k] for k in heldout}
    fpr_best = heldout_fpr(best, {k: env_view(d) for k, d in ho.items()}, fpr_sizes)
    fpr_single = heldout_fpr(single, ho, fpr_sizes)
    fpr_lr = heldout_fpr(det_all, ho, fpr_sizes)
    cm = ClippedMeanDetector(clip_quantile=0.999).fit(h_tr)
    fpr_margin = heldout_fpr(cm, ho, fpr_sizes)
    cm_strat = ClippedMeanDetector(clip_quantile=0.999).fit(h_tr, groups=h_groups)
    fpr_margin_strat = heldout_fpr(cm_strat, ho, fpr_sizes)
    mean_fpr = lambda f: float(np.mean([v for row in f.values() for v in row.values()])) if f else None  # noqa: E731

    # temperature-tuning attack at 1000 tokens
    attack = None
    if "int4-tuned" in data:
        at = json.loads((CACHE / "attack_temperature.json").read_text())
        rows = {}
        for key in ("int4-tuned", "int4"):
            det_loo = LikelihoodRatioDetector().fit(h_tr, alternatives=[tr[o] for o in misconf if o != "int4"])
            row = {n: auc_curve(h_vals[n], sc.values(n, te[key]), (1000,), seed=4)[1000]
                   for n in ("cross_entropy", "margin_clip99.9", "likelihood", "exact_match")}
            row["lr_combined"] = auc_curve(det_loo.token_scores(h_te), det_loo.token_scores(te[key]), (1000,), seed=4)[1000]
            row["best"] = best_curve(best, h_ev, ev[key], (1000,), seed=4)[1000]
            ce = data[key]["cross_entropy"]
            row["mean_cross_entropy"] = float(ce[np.isfinite(ce)].mean())
            rows[key] = row
        hce = cat([data[k] for k in honest])["cross_entropy"]
        attack = {"temperature": at["temperature"], "search": at, "honest_mean_cross_entropy": float(hce[np.isfinite(hce)].mean()),
                  "auc_at_1pct_fpr_1000_tokens": rows}

    margin = ttd["margin_clip99.9"]
    check = {}
    for m in misconf:
        a, b = margin[m], ttd["best"][m]
        if a is not None and 10 < a <= 10000:
            ok = b is not None and b <= a / 2
        elif a is not None and a <= 10:
            ok = b is not None and b <= a
        else:
            ok = None  # margin never detects within 10000: no requirement
        check[m] = {"margin_clip99.9": a, "best": b, "ok": ok}
    result = {
        "tokens_to_detect": ttd,
        "heldout_honest_fpr": mean_fpr(fpr_best),
        "heldout_honest_fpr_max_cell": max(v for row in fpr_best.values() for v in row.values()) if fpr_best else None,
        "heldout_honest_fpr_by_config": fpr_best,
        "heldout_honest_fpr_glrt_single_replay": mean_fpr(fpr_single),
        "heldout_honest_fpr_margin_clip99.9": mean_fpr(fpr_margin),
        "heldout_honest_fpr_margin_clip99.9_stratified_null": mean_fpr(fpr_margin_strat),
        "heldout_honest_fpr_margin_stratified_by_config": fpr_margin_strat,
        "heldout_honest_fpr_lr_combined": mean_fpr(fpr_lr),
        "heldout_honest_fpr_lr_combined_by_config": fpr_lr,
        "heldout_honest_fpr_margin_by_config": fpr_margin,
        "best_vs_margin": check,
        "tokens_to_detect_fine_grid": ttd_fine,
        "mismatch_oracle_auc": {m: {str(b): v for b, v in c.items()} for m, c in oracle.items()},
        "mismatch_oracle_tokens_to_detect": {m: tokens_to_detect(c) for m, c in oracle.items()},
        "feasibility": ceilings,
        "attack": attack,
        "auc_at_1pct_fpr": {m: {n: {str(b): v for b, v in c.items()} for n, c in by.items()} for m, by in curves.items()},
        "auc_at_1pct_fpr_ipt": {m: {n: {str(b): v for b, v in c.items()} for n, c in by.items()} for m, by in ipt_curves.items()},
        "auc_at_1pct_fpr_fine": {m: {n: {str(b): v for b, v in c.items()} for n, c in by.items()} for m, by in fine.items()},
        "setup": {"tokens": {k: int(len(d["margin"])) for k, d in data.items()}, "honest_pool": honest,
                  "heldout_honest": heldout, "fitted": {**sc.fit, **(isc.fit if ipt_curves else {})},
                  "clips": {k: v for k, v in sc.clip.items()}, "batches_per_size": N_BATCHES, "mc_trials": MC_TRIALS,
                  "split": "token-level 50/50 train/test per configuration (seeded)",
                  "best": BEST_DESCRIPTION,
                  "references": {r: {"numerics": ref.numerics.to_dict(), "decode": ref.decode}
                                 for r, ref in REFERENCES.items()},
                  "best_config": {k: list(v) if isinstance(v, tuple) else v for k, v in BEST_CONFIG.items()},
                  "best_fitted": {"sigma0": best.sigma0_, "eps0": best.eps0_, "grid": best.grid_,
                                  "alternatives": [best.describe(g) for g in range(len(best.grid_))],
                                  "tau_over_sd": (best.tau_ / best.sd_).tolist()},
                  "lr_combined": "LikelihoodRatioDetector over (margin band, logit direction, cross-entropy band), "
                                 "honest train + train halves of the OTHER misconfigurations (leave-one-out)",
                  "machine": f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)",
                  "command": "python -m benchmarks.detection_lab", "seconds": time.perf_counter() - t0},
    }
    out = RESULTS
    out.mkdir(parents=True, exist_ok=True)
    from verinfer.io import atomic_write_text

    atomic_write_text(out / "detection_lab.json", json.dumps(result, indent=1, default=float))
    plot_curves(curves, out / "detection_lab_auc.png", "Token-DiFR variants (Gumbel sampling, vllm-cpu)")
    if ipt_curves:
        plot_curves(ipt_curves, out / "detection_lab_ipt.png", "IPT-DiFR (inverse-CDF sampling)")
    plot_curves({m: {n: fine[m][n] for n in fine[m]} for m in fine}, out / "detection_lab_best.png",
                "best (perturbation GLRT) vs margin clipped at 99.9, fine batch grid")
    write_markdown(out / "detection_lab.md", markdown(result))
    log(markdown(result))
    return result


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def markdown(r: dict) -> str:
    ttd = r["tokens_to_detect"]
    ms = list(next(iter(ttd.values())))
    L = ["# DiFR detection study on the shipped testbed", "", f"Command: `{r['setup']['command']}`  ",
         f"Tokens per configuration: {r['setup']['tokens']}", "",
         "## Tokens to detect (smallest batch with AUC@1%FPR >= 0.99; '-' = not within 10000)", "",
         "| score | " + " | ".join(ms) + " |", "|---|" + "---|" * len(ms)]
    for n, by in ttd.items():
        L.append(f"| {n} | " + " | ".join(_fmt(by[m]) for m in ms) + " |")
    L += ["", "Rows are on the Gumbel (vllm-cpu) claim sets with a 5-configuration honest pool, except ipt_difr: "
          "inverse-CDF claim sets (same misconfigurations) against a 3-configuration inverse-CDF honest pool. "
          "lr_combined = binned likelihood ratio (leave-one-misconfiguration-out).", "",
          f"best = {BEST_DESCRIPTION}", "",
          f"Fitted on the honest train tokens: sigma0 = {r['setup']['best_fitted']['sigma0']:.4g}, eps0 = "
          f"{r['setup']['best_fitted']['eps0']:.3g}; alternatives: {', '.join(r['setup']['best_fitted']['alternatives'])}.",
          "", "## best vs margin clipped at 99.9 (done-when: best <= half where 10 < margin <= 10000)", "",
          "| misconfiguration | margin_clip99.9 | best | ok |", "|---|---|---|---|"]
    for m, c in r["best_vs_margin"].items():
        L.append(f"| {m} | {_fmt(c['margin_clip99.9'])} | {_fmt(c['best'])} | {_fmt(c['ok'])} |")
    L += ["", f"Fine grid {FINE_SIZES}: " + json.dumps(r["tokens_to_detect_fine_grid"]), ""]
    L += feasibility_markdown(r)
    L += ["Mismatch oracle (not a ceiling: it scores every honest batch 0): AUC@1%FPR of an oracle that sees which "
          "tokens the bf16 replay does not reproduce and knows which of those the misconfiguration caused; tokens to detect "
          + json.dumps(r["mismatch_oracle_tokens_to_detect"]) + "; AUC at 100 / 300 tokens: "
          + json.dumps({m: [round(c["100"], 4), round(c["300"], 4)] for m, c in r["mismatch_oracle_auc"].items()}), "",
          f"Held-out honest FPR of `best` at a 1% target: mean {_fmt(r['heldout_honest_fpr'])}, worst cell "
          f"{_fmt(r['heldout_honest_fpr_max_cell'])} (200 batches per cell); ClippedMeanDetector on margin_clip99.9: pooled null "
          f"{_fmt(r['heldout_honest_fpr_margin_clip99.9'])}, stratified null {_fmt(r['heldout_honest_fpr_margin_clip99.9_stratified_null'])}; "
          f"lr_combined {_fmt(r['heldout_honest_fpr_lr_combined'])}", "",
          "| held-out config | " + " | ".join(f"b={b}" for b in next(iter(r["heldout_honest_fpr_by_config"].values()), {})) + " |",
          "|---|" + "---|" * len(next(iter(r["heldout_honest_fpr_by_config"].values()), {}))]
    for k, row in r["heldout_honest_fpr_by_config"].items():
        L.append(f"| {k} | " + " | ".join(f"{v:.3f}" for v in row.values()) + " |")
    for title, key in (("AUC@1%FPR, Token-DiFR variants", "auc_at_1pct_fpr"), ("AUC@1%FPR, IPT-DiFR (inverse-CDF sampling)", "auc_at_1pct_fpr_ipt")):
        for m, by in r[key].items():
            L += ["", f"### {title}: {m}", "", "| score | " + " | ".join(str(b) for b in BATCH_SIZES) + " |",
                  "|---|" + "---|" * len(BATCH_SIZES)]
            for n, c in by.items():
                L.append(f"| {n} | " + " | ".join(_fmt(c.get(str(b))) for b in BATCH_SIZES) + " |")
    a = r.get("attack")
    if a:
        L += ["", "## Temperature-tuning attack (4-bit weights, temperature tuned to match honest cross-entropy)", "",
              f"Tuned temperature {a['temperature']}: int4 probes on the same {N_ATTACK_PROBE} prompts and seeds as honest-bf16-b8 "
              f"(honest mean CE {a['search']['honest_mean_cross_entropy_same_prompts']:.4f}) gave mean CE by temperature "
              f"{ {k: round(v, 4) for k, v in a['search']['probe_mean_cross_entropy'].items()} }; interpolated. On this testbed "
              f"4-bit RTN at T=1 does not raise cross-entropy, so the attacker raises T slightly. The table's providers "
              f"run on the misconfiguration prompt set; honest pool mean CE {a['honest_mean_cross_entropy']:.4f}.", "",
              "| provider | mean CE | cross_entropy | margin_clip99.9 (Token-DiFR) | likelihood | exact_match | lr_combined | best |",
              "|---|---|---|---|---|---|---|---|"]
        for k, row in a["auc_at_1pct_fpr_1000_tokens"].items():
            L.append(f"| {k} | {row['mean_cross_entropy']:.4f} | " + " | ".join(
                _fmt(row[n]) for n in ("cross_entropy", "margin_clip99.9", "likelihood", "exact_match", "lr_combined", "best")) + " |")
        L.append("")
        L.append("AUC@1%FPR at 1000 tokens.")
    L += ["", "## Plots", "", "![Token-DiFR variants](detection_lab_auc.png)", "", "![IPT-DiFR](detection_lab_ipt.png)", "",
          "![best vs margin](detection_lab_best.png)", ""]
    return "\n".join(L) + "\n"


def feasibility_markdown(r: dict) -> list[str]:
    """The feasibility section: per misconfiguration, the batch size the half-tokens target asks
    for, best's AUC there, and the two ceilings of `feasibility` at that size."""
    f = r.get("feasibility") or {}
    if not f:
        return []
    L = ["## Can any detector do it? (at the batch size the half-tokens target asks for)", "",
         "target n = the largest ladder size <= margin_clip99.9's tokens / 2 (<= margin's where it needs <= 10). "
         "gap oracle = AUC@1%FPR of the summed binned log-likelihood ratio of the envelope gap, fitted on the "
         "misconfiguration's OWN train half (knows its gap distribution; a ceiling for per-token gap evidence). "
         "agreement bound = `metrics.auc_at_fpr_bound`: a token carries evidence only where the misconfigured and "
         "the honest sampler would choose differently (rho per token: not reproduced by any honest reference; for "
         "temp-1.1: the replay's choices at T and 1.1 T differ, rho_honest likewise on honest tokens), so with "
         "probability (1 - rho)^n a batch of n tokens has none and looks honest (token-level model).", "",
         "| misconfiguration | margin_clip99.9 | target n | best AUC at n | gap oracle AUC at n | rho | rho_honest | "
         "agreement bound at n | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for m, c in f.items():
        a = r["best_vs_margin"][m]["margin_clip99.9"]
        n = target_batch(a)
        if n is None:
            L.append(f"| {m} | {_fmt(a)} | - | - | - | {c['rho']:.4f} | {c['rho_honest']:.5f} | - | no requirement |")
            continue
        best_auc = r["auc_at_1pct_fpr"][m]["best"].get(str(n))
        orc, bnd = c["gap_oracle_auc"].get(str(n)), c["agreement_bound_auc"].get(str(n))
        verdict = ("met" if best_auc is not None and best_auc >= 0.99 else
                   "infeasible (bound < 0.99)" if bnd is not None and bnd < 0.99 else
                   "beyond per-token gap evidence (oracle < 0.99)" if orc is not None and orc < 0.99 else "not met")
        L.append(f"| {m} | {_fmt(a)} | {n} | {_fmt(best_auc)} | {_fmt(orc)} | {c['rho']:.4f} | {c['rho_honest']:.5f} | "
                 f"{_fmt(bnd)} | {verdict} |")
    return L + [""]


def target_batch(margin_tokens) -> int | None:
    """The largest ladder batch size meeting the done-when for a margin that needs margin_tokens."""
    if margin_tokens is None or margin_tokens > 10000:
        return None
    limit = margin_tokens / 2 if margin_tokens > 10 else margin_tokens
    ok = [b for b in BATCH_SIZES if b <= limit]
    return max(ok) if ok else None


def plot_curves(curves: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.6), sharey=True)
    for ax, (m, by) in zip(np.atleast_1d(axes), curves.items()):
        for n, c in by.items():
            xs = [int(b) for b, v in c.items() if v is not None]
            style = dict(color="black", lw=2.4) if n == "best" else dict(lw=1.1, color=colors[list(by).index(n) % len(colors)])
            ax.plot(xs, [c[b] for b in c if c[b] is not None], marker="o", ms=3, label=n, **style)
        ax.set_xscale("log")
        ax.axhline(0.99, color="grey", lw=0.8, ls="--")
        ax.set_title(m)
        ax.set_xlabel("tokens per batch")
    np.atleast_1d(axes)[0].set_ylabel("AUC @ 1% FPR")
    np.atleast_1d(axes)[-1].legend(fontsize=6, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", choices=("data", "features", "references", "grid", "all"), default="all")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine 2 threads oversubscribe and run ~30x slower)")
    ap.add_argument("--attack-first", action="store_true", help="data stage: attack first, then sets in reverse; "
                    "features and references stages: in reverse order (a second worker meeting the first one in the middle)")
    ap.add_argument("--cache", type=Path, default=None, help="cache directory (default benchmarks/.cache/detection_lab)")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    global CACHE, RESULTS
    CACHE = a.cache or CACHE
    RESULTS = a.out or RESULTS
    log = lambda s: print(s, flush=True)  # noqa: E731
    if a.stage in ("data", "all"):
        stage_data(log, a.attack_first)
    if a.stage in ("features", "all"):
        stage_features(log, reverse=a.attack_first)
    if a.stage in ("references", "all"):
        stage_references(log, reverse=a.attack_first)
    if a.stage in ("grid", "all"):
        stage_grid(log)


if __name__ == "__main__":
    main()
