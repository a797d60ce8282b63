"""Audit link: a provider runs the lossy KL judge while claiming standard speculative sampling.
How many output tokens does the audit need to catch it?

    .venv/bin/python -m benchmarks.kl_judge_audit [--n 128] [--max-tokens 64]
    .venv/bin/python -m benchmarks.kl_judge_audit --model smollm2-135m-instruct   # the real pair (its
        # distilled draft, models/drafts/); prompts: the next-line task's validation contexts
    .venv/bin/python -m benchmarks.kl_judge_audit --model smollm2-135m-instruct --head --threshold 0.5
        # the draft is the target's feature-level head (models/drafts/<target>-head, head_build.py)
    .venv/bin/python -m benchmarks.kl_judge_audit --quick --head-dir DIR   # a small smoke run

Honest provider: standard speculative sampling (gamma 4, temperature 1, audit prompts of
models/corpus.eval_prompts). Misconfigured: the KL judge at each threshold, claims labelled
"standard". Both send per-token events (a/r/b; with a head the first token is the target's own,
t); the verifier (speculative/spec_claims.py: with a head, q is the head's chain on the target's
features) scores every output token by -log min(1, p/q) on accepted draft tokens (0 otherwise,
+inf on violations) and the DiFR protocol (detect/metrics.auc_vs_tokens: 50/50 token split,
winsorize at the 0.999 honest quantile, batch means) gives AUC@1%FPR by batch size;
tokens-to-detect = smallest batch reaching 0.99. Writes benchmarks/results/kl_judge_audit.{json,md}
(with --model: kl_judge_audit_<model>.*; with --head or --head-dir: the stem + "_head"; --quick:
+ "_quick", 8 prompts x 16 tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.markdown import write_markdown
from verinfer.models.corpus import eval_prompts
from verinfer.models.llama import LlamaLM
from verinfer.models.load import load_tokenizer
from verinfer.models.testbed import DRAFT_DIR, TARGET_DIR, TOKENIZER_DIR
from verinfer.detect.metrics import auc_vs_tokens, tokens_to_detect
from verinfer.speculative.feature_head import FeatureHead
from verinfer.speculative.rules import Rule
from verinfer.speculative.spec_claims import spec_claims, verify_spec_claims


def tokens_to_detect_kl_provider(target: LlamaLM, draft: "LlamaLM | FeatureHead", prompts: list[list[int]], *, threshold: float,
                                 gamma: int = 4, temperature: float = 1.0, max_tokens: int = 64, seed: int = 0,
                                 batch_size: int = 16, model_name: str = "testbed-target",
                                 draft_name: str = "testbed-draft") -> dict:
    """Honest standard provider vs a provider running the KL judge at `threshold` while claiming
    standard, both drafting with `draft` (a separate draft model or a FeatureHead): per-token scores,
    AUC@1%FPR by batch size (DiFR protocol), tokens-to-detect."""
    res = {}
    scores = {}
    for name, rule, s in [("honest_standard", Rule("standard"), seed), ("kl_claims_standard", Rule("kl", threshold), seed + 7)]:
        cl = spec_claims(target, draft, prompts, run_rule=rule, claimed="standard", gamma=gamma, temperature=temperature,
                         max_tokens=max_tokens, seed=s, model_name=model_name, draft_name=draft_name,
                         provider=name, batch_size=batch_size)
        rows = verify_spec_claims(cl, target, draft)
        scores[name] = rows["score"]
        a = rows["event"] == "a"
        res[name] = {"tokens": int(rows["score"].size), "accepted_fraction": float(a.mean()),
                     "violations": int(rows["violation"].sum()),
                     "mean_accept_nll": float(rows["accept_nll"][a].mean()) if a.any() else 0.0}
    curve = auc_vs_tokens(scores["honest_standard"], scores["kl_claims_standard"],
                          batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000), rng=np.random.default_rng(seed))
    res["auc_at_1pct_fpr_by_tokens"] = {str(k): v for k, v in curve.items()}
    res["tokens_to_detect"] = tokens_to_detect(curve)
    res["setup"] = {"threshold": threshold, "gamma": gamma, "temperature": temperature, "max_tokens": max_tokens,
                    "prompts": len(prompts)}
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--thresholds", "--threshold", dest="thresholds", type=float, nargs="+", default=[0.1, 0.5, 2.0],
                    help="KL-judge thresholds the misconfigured provider runs (one run each)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--model", default=None, help="a catalog name or directory: the target (default: the testbed); "
                    "its draft is models/drafts/<name>-draft unless --draft says otherwise")
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--head", action="store_true", help="draft with the target's feature-level head "
                    "(models/drafts/<target>-head, `verinfer models build-head`) instead of a separate draft")
    ap.add_argument("--head-dir", type=Path, default=None,
                    help="draft with the head in this directory (implies --head)")
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens (a smoke run; stem + _quick)")
    a = ap.parse_args(argv)
    if a.quick:
        a.n, a.max_tokens = 8, 16
    head = a.head or a.head_dir is not None
    torch.set_num_threads(1)
    t0 = time.time()
    stem = "kl_judge_audit"
    if a.model is None:
        tok = load_tokenizer(TOKENIZER_DIR)
        tdir = TARGET_DIR
        target = LlamaLM.from_pretrained(TARGET_DIR)
        draft = None if head else LlamaLM.from_pretrained(DRAFT_DIR)
        prompts = eval_prompts(tok, a.n, seed=11)
        names = dict(model_name="testbed-target", draft_name="testbed-draft")
    else:
        from verinfer.models import nextline
        from verinfer.models.catalog import resolve_model
        from verinfer.models.draft import default_out
        from verinfer.models.load import load_tokenizer as load_tok, model_info

        tdir = resolve_model(a.model)
        tok = load_tok(tdir)
        target = LlamaLM.from_pretrained(tdir, dtype=torch.bfloat16)
        draft = ddir = None
        if not head:
            ddir = a.draft or default_out(tdir)
            draft = LlamaLM.from_pretrained(ddir, dtype=torch.bfloat16)
        prompts = [list(p.prompt_ids) for p in nextline.problems(tok, a.n)]
        names = dict(model_name=model_info(tdir).name, draft_name=None if head else model_info(ddir).name)
        stem += "_" + tdir.name
    if head:
        from verinfer.speculative.head_build import default_out as head_out
        from verinfer.speculative.feature_head import FeatureHead

        hdir = a.head_dir or head_out(tdir)
        draft = FeatureHead.from_target(hdir, target)
        names["draft_name"] = Path(hdir).name
        stem += "_head"
    if a.quick:
        stem += "_quick"
    res = {"command": "benchmarks/kl_judge_audit.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "draft_kind": "head" if head else "model", "by_threshold": {}, **names}
    for thr in a.thresholds:
        r = tokens_to_detect_kl_provider(target, draft, prompts, threshold=thr, max_tokens=a.max_tokens, seed=0,
                                         **names)
        res["by_threshold"][str(thr)] = r
        print(thr, r["tokens_to_detect"], r["kl_claims_standard"], flush=True)
    res["seconds"] = time.time() - t0
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    what = "its feature-level head" if head else "its draft"
    L = [f"# Audit: KL judge claimed as standard speculative sampling ({names['model_name']} with "
         f"{what} {names['draft_name']})", "",
         f"`{res['command']}`: {a.n} audit prompts x {a.max_tokens} tokens per provider, gamma 4, temperature 1.", "",
         "| KL threshold | tokens-to-detect (AUC@1%FPR >= 0.99) | honest accepted frac | KL accepted frac | honest mean -log min(1,p/q) | KL mean | violations (honest / KL) | AUC by tokens |",
         "|---:|---:|---:|---:|---:|---:|---|---|"]
    for thr, r in res["by_threshold"].items():
        h, k = r["honest_standard"], r["kl_claims_standard"]
        curve = ", ".join(f"{b}: {v:.3f}" for b, v in r["auc_at_1pct_fpr_by_tokens"].items() if v is not None)
        L.append(f"| {thr} | {r['tokens_to_detect']} | {h['accepted_fraction']:.3f} | {k['accepted_fraction']:.3f} | "
                 f"{h['mean_accept_nll']:.4f} | {k['mean_accept_nll']:.4f} | {h['violations']} / {k['violations']} | {curve} |")
    L += ["", "Tokens-to-detect None = not reached within the largest batch evaluated (limited by the test half of "
          "the tokens)."]
    if head:
        L += ["", "Accepted fraction: the share of output tokens that are accepted head drafts (the first token of "
              "every claim is the target's own)."]
    L += [f"Total {res['seconds']:.0f} s.", ""]
    write_markdown(a.out / f"{stem}.md", "\n".join(L))
    return res


if __name__ == "__main__":
    main()
