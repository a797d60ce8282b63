"""One harness for speculative decoding on the testbed: cost model, MAT, accuracy, tokens/s.

Task: held-out arithmetic problems (models/corpus.py), zero-shot prompt "Q: 37+45=\\nA: ",
greedy decoding (temperature 0) until a token containing a newline or `max_tokens`. Accuracy =
the continuation starts with the exact answer followed by a non-digit (corpus.arithmetic_accuracy);
`agreement` = the continuation's final answer equals target-only greedy decoding's (a fidelity
measure that sees changes even where both answers are wrong).

Metrics:
  mat            emitted tokens / target forwards (prefill excluded); COUNTS the token the target
                 contributes in every round (correction or bonus), so target-only decoding has 1.0
  accept_rate    accepted draft tokens / drafted tokens
  tokens_per_s   generated tokens / wall-clock seconds of the whole generate call (prefill of both
                 models, drafting, verification, rule evaluation), median over interleaved repeats
Protocol (benchmarks/kl_judge.py): thresholds and gammas are chosen on a validation split of the
held-out problems, the reported numbers come from the disjoint test split. MAT is compared at
equal gamma; tokens/s compares each method at its own fastest gamma (timed on validation), so
vanilla speculative sampling is never handicapped.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from verinfer.models.corpus import Problem
from verinfer.models.llama import LlamaLM
from verinfer.speculative.judge import final_answer
from verinfer.speculative.loop import SpecOutput, SpeculativeDecoder, autoregressive
from verinfer.speculative.rules import Rule

# Threshold grids (the knob of each rule; see rules.py for the direction of each)
GRIDS: dict[str, list[float]] = {
    "standard": [0.0],
    "kl": [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0],
    "topk": [2, 3, 5, 10, 20],
    "target_entropy": [5.0, 4.0, 3.0, 2.5, 2.25, 2.0, 1.5, 1.0],
    "draft_entropy": [0.1, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0],
    "autojudge": [0.1, 0.5, 0.9],
}


def newline_tokens(tokenizer) -> tuple[int, ...]:
    return tuple(i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i]))


def accuracy(tokenizer, problems: list[Problem], outs: list[SpecOutput]) -> float:
    ok = 0
    for (_, a), o in zip(problems, outs):
        s = tokenizer.decode(o.output_token_ids)
        ok += s.startswith(a) and not s[len(a) : len(a) + 1].isdigit()
    return ok / len(problems)


def agreement(tokenizer, outs: list[SpecOutput], ref: list[SpecOutput]) -> float:
    same = sum(final_answer(tokenizer.decode(o.output_token_ids)) == final_answer(tokenizer.decode(r.output_token_ids))
               for o, r in zip(outs, ref))
    return same / len(ref)


def summarize(tokenizer, problems, outs, ref=None) -> dict:
    tokens = sum(len(o.output_token_ids) for o in outs)
    fwd = sum(o.target_forwards for o in outs)
    drafted = sum(o.drafted for o in outs)
    d = {"mat": tokens / fwd, "accuracy": accuracy(tokenizer, problems, outs), "tokens": tokens,
         "target_forwards": fwd, "accept_rate": (sum(o.accepted for o in outs) / drafted) if drafted else None}
    if ref is not None:
        d["agreement"] = agreement(tokenizer, outs, ref)
    return d


@dataclass
class Method:
    """A decoding configuration: rule=None means target-only decoding."""

    name: str
    rule: Rule | None
    gamma: int = 0

    def run(self, target: LlamaLM, draft: LlamaLM, prompts, max_tokens, stop, batch_size) -> list[SpecOutput]:
        if self.rule is None:
            return autoregressive(target, prompts, max_tokens, stop_token_ids=stop, batch_size=batch_size)
        dec = SpeculativeDecoder(target, draft, self.rule, gamma=self.gamma, stop_token_ids=stop)
        return dec.generate(prompts, max_tokens, batch_size=batch_size)


def timed_run(m: Method, *args) -> tuple[list[SpecOutput], float]:
    t0 = time.perf_counter()
    outs = m.run(*args)
    return outs, time.perf_counter() - t0


def interleaved_timing(methods: list[Method], target, draft, prompts, max_tokens, stop, batch_size,
                       repeats: int, progress=None) -> dict[str, dict]:
    """Run every method `repeats` times, rotating the order each repeat (a shared, noisy machine
    slows all methods of a repeat alike); tokens/s = median over repeats."""
    res: dict[str, dict] = {m.name: {"seconds": [], "tokens": None, "outs": None} for m in methods}
    for r in range(repeats):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for m in order:
            outs, sec = timed_run(m, target, draft, prompts, max_tokens, stop, batch_size)
            toks = sum(len(o.output_token_ids) for o in outs)
            e = res[m.name]
            if e["outs"] is not None and [o.output_token_ids for o in outs] != [o.output_token_ids for o in e["outs"]]:
                raise RuntimeError(f"{m.name}: greedy outputs changed between repeats (nondeterministic kernel?)")
            e["seconds"].append(sec)
            e["tokens"], e["outs"] = toks, outs
            if progress is not None:
                progress(f"repeat {r + 1}/{repeats} {m.name}: {toks / sec:.0f} tok/s")
    for e in res.values():
        e["tokens_per_s"] = e["tokens"] / statistics.median(e["seconds"])
        e["tokens_per_s_all"] = [e["tokens"] / s for s in e["seconds"]]
    return res


# --- cost model -----------------------------------------------------------------------------
def _median_ms(fn, n: int) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _median_ms_pair(f, g, n: int) -> tuple[float, float]:
    for _ in range(5):
        f()
        g()
    tf, tg = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        t1 = time.perf_counter()
        g()
        t2 = time.perf_counter()
        tf.append(t1 - t0)
        tg.append(t2 - t1)
    return statistics.median(tf) * 1e3, statistics.median(tg) * 1e3


@torch.no_grad()
def cost_model(model_dirs: dict[str, str], batch_sizes=(1, 16), ctx: int = 128, T_verify: int = 5,
               n: int = 100, device: str = "cpu") -> dict:
    """Median ms of one decode step (T=1) and of a T_verify-token verification forward at a
    ctx-token context: the lean forward (static KV cache) vs transformers (DynamicCache), fp32.
    Also the max |logit diff| lean vs transformers on the same step (the fast path's check)."""
    from transformers import AutoModelForCausalLM

    out: dict = {}
    for name, d in model_dirs.items():
        lean = LlamaLM.from_pretrained(d, device=device)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(device).eval()
        for B in batch_sizes:
            ids = torch.randint(3, lean.config.vocab_size, (B, ctx + T_verify), generator=torch.Generator().manual_seed(0)).to(device)
            cache = lean.new_cache(B, ctx + T_verify + 1)
            lean(ids[:, :ctx], torch.arange(ctx, device=device).expand(B, -1), cache)
            hout = hf(ids[:, :ctx], use_cache=True)
            pkv = hout.past_key_values
            row = {}
            for T in (1, T_verify):
                tok, pos = ids[:, ctx : ctx + T], (ctx + torch.arange(T, device=device)).expand(B, -1)

                def hf_step():
                    hf(tok, past_key_values=pkv, use_cache=True)
                    pkv.crop(-T)
                # interleaved (lean, hf, lean, hf, ...): a shared machine's load hits both alike
                lean_ms, hf_ms = _median_ms_pair(lambda: lean(tok, pos, cache), hf_step, n)
                row[f"lean_T{T}_ms"], row[f"hf_T{T}_ms"] = lean_ms, hf_ms
                lg, _ = lean(tok, pos, cache)
                ref = hf(tok, past_key_values=pkv, use_cache=True).logits
                pkv.crop(-T)
                row[f"max_abs_logit_diff_T{T}"] = float((lg - ref).abs().max())
            out[f"{name}_b{B}"] = row
        out[f"{name}_params"] = sum(t.numel() for k, t in lean.w.items()
                                    if not (k == "lm_head.weight" and lean.config.tie_word_embeddings))
    return out


# --- the whole benchmark ----------------------------------------------------------------------
LABELS = {"standard": "vanilla", "kl": "kl_judge", "topk": "topk", "target_entropy": "target_entropy",
          "draft_entropy": "draft_entropy", "autojudge": "autojudge"}
GAMMAS = [1, 2, 3, 4, 6]
REF_GAMMA = 4          # MAT compared at this equal gamma
N_TEST_B1 = 250       # batch-1 timings use the first 250 test problems
SELECT_MARGIN = 0.01   # a threshold qualifies when its validation accuracy is >= vanilla's - 1 point (issue 7)


def select_thresholds(sweep: list[dict], vanilla_acc: dict[int, float]) -> dict[str, dict[int, float]]:
    """Per rule and gamma: the threshold with the highest validation MAT among those whose
    validation accuracy is at least vanilla's minus SELECT_MARGIN (ties: the stricter threshold,
    i.e. the first in the grid)."""
    best: dict[str, dict[int, float]] = {}
    for rule in GRIDS:
        best[rule] = {}
        for g in sorted({r["gamma"] for r in sweep}):
            rows = [r for r in sweep if r["rule"] == rule and r["gamma"] == g
                    and r["accuracy"] >= vanilla_acc[g] - SELECT_MARGIN - 1e-12]
            if rows:
                best[rule][g] = max(rows, key=lambda r: (r["mat"], -GRIDS[rule].index(r["threshold"])))["threshold"]
    return best


def run(out_dir, device: str = "cpu", quick: bool = False, batch_sizes=(16, 1), repeats: int = 5,
        log=print) -> dict:
    """Everything behind benchmarks/results/kl_judge.{json,md,png}; returns the results dict."""
    import json
    from pathlib import Path

    from verinfer.models.corpus import heldout_problems, train_problems
    from verinfer.models.load import model_info
    from verinfer.models.testbed import DRAFT_DIR, TARGET_DIR, load_tokenizer
    from verinfer.speculative.judge import mine, train_judge

    torch.set_num_threads(1)
    t_start = time.time()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer()
    target = LlamaLM.from_pretrained(TARGET_DIR, device=device)
    draft = LlamaLM.from_pretrained(DRAFT_DIR, device=device)
    stop, max_tokens = newline_tokens(tok), 8
    held = heldout_problems(1000)
    n_val, n_test, n_mine = (60, 100, 40) if quick else (300, 700, 300)
    val, test = held[:n_val], held[300 : 300 + n_test]
    enc = lambda ps: [tok.encode(q, add_special_tokens=False) for q, _ in ps]  # noqa: E731
    val_p, test_p = enc(val), enc(test)
    gammas = [2, 4] if quick else GAMMAS
    res: dict = {"setup": {
        "task": "held-out arithmetic (models/corpus.py), zero-shot 'Q: a op b=\\nA: ', greedy, stop at a newline token, "
                f"max_tokens {max_tokens}", "validation_problems": f"heldout[0:{n_val}]",
        "test_problems": f"heldout[300:{300 + n_test}]", "gammas": gammas, "ref_gamma_for_mat": REF_GAMMA,
        "threshold_selection": f"max validation MAT with validation accuracy >= vanilla - {SELECT_MARGIN * 100:.1f} point",
        "mat_definition": "emitted tokens per target forward, prefill excluded; COUNTS the correction/bonus token",
        "tokens_per_s": f"generated tokens / wall seconds of the generate call (prefill included), median of "
                        f"{repeats} interleaved repeats, torch threads 1, shared 2-core CPU",
        "device": device, "torch": torch.__version__, "quick": quick}}

    log("cost model ...")
    res["cost_model"] = cost_model({"target": str(TARGET_DIR), "draft": str(DRAFT_DIR)},
                                   batch_sizes=(1,) if quick else (1, 16), n=20 if quick else 100, device=device)

    log(f"mining AutoJudge labels on {n_mine} training problems ...")
    t0 = time.time()
    mined = mine(target, draft, tok, enc(train_problems(n_mine, seed=1)), max_tokens, stop)
    judge = train_judge(mined)
    judge.to_json(out_dir / "kl_judge_autojudge.json")
    res["judge_mining"] = {"problems": mined.problems, "mismatches": int(mined.labels_N.numel()),
                           "important_fraction": float(mined.labels_N.float().mean()),
                           "mismatches_per_problem": mined.mismatches_per_problem,
                           "feature_dim": int(mined.feats_ND.shape[1]), "seconds": time.time() - t0}
    log(f"  {res['judge_mining']}")

    ref_val = autoregressive(target, val_p, max_tokens, stop_token_ids=stop, batch_size=16)
    ref_test = autoregressive(target, test_p, max_tokens, stop_token_ids=stop, batch_size=16)
    rule_of = lambda name, thr: Rule(name, thr, judge if name == "autojudge" else None)  # noqa: E731

    log("threshold x gamma sweep on validation ...")
    # greedy outputs are deterministic: cache sweep rows (keyed by config, models and split) so a
    # re-run (e.g. another selection rule) does not recompute them
    cache_path = out_dir.parent / ".cache" / "kl_judge_sweep.json"  # benchmarks/.cache (git-ignored)
    key_base = f"{mined.labels_N.sum().item()}:{n_val}:{max_tokens}:{model_info(TARGET_DIR).weights_sha256}:" \
               f"{model_info(DRAFT_DIR).weights_sha256}"
    cached = json.loads(cache_path.read_text()) if cache_path.is_file() else {}

    def point(key, name, thr, g, prompts, problems, ref):
        """One (rule, threshold, gamma) run summarized, from the cache when it is there."""
        if key not in cached:
            outs = Method(name, rule_of(name, thr), g).run(target, draft, prompts, max_tokens, stop, 16)
            cached[key] = {"rule": name, "threshold": thr, "gamma": g, **summarize(tok, problems, outs, ref)}
        return cached[key]

    def save_cache():
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cached))
        tmp.replace(cache_path)

    sweep = []
    for g in gammas:
        for name, grid in GRIDS.items():
            sweep += [point(f"{key_base}:{name}:{thr}:{g}", name, thr, g, val_p, val, ref_val) for thr in grid]
            save_cache()
            log(f"  gamma {g} {name}: " + " ".join(f"{r['threshold']}:{r['mat']:.2f}/{r['accuracy']:.3f}"
                                                     for r in sweep if r["rule"] == name and r["gamma"] == g))
    res["sweep_validation"] = sweep
    res["target_only_validation"] = summarize(tok, val, ref_val, ref_val)
    vanilla_acc = {g: next(r["accuracy"] for r in sweep if r["rule"] == "standard" and r["gamma"] == g) for g in gammas}
    best = select_thresholds(sweep, vanilla_acc)
    res["selected_threshold"] = {LABELS[k]: v for k, v in best.items()}

    # fastest gamma per method and batch size (validation, 2 interleaved repeats)
    res["fastest_gamma"], res["timing_validation"], res["test"] = {}, {}, {}
    for bs in batch_sizes:
        vp = val_p if bs > 1 else val_p[: max(30, n_val // 3)]
        cands = [Method("target_only", None)] + [Method(f"{LABELS[k]}@{g}", rule_of(k, best[k][g]), g)
                                                 for k in GRIDS for g in gammas if g in best[k]]
        log(f"batch {bs}: timing {len(cands)} candidates on validation ...")
        tv = interleaved_timing(cands, target, draft, vp, max_tokens, stop, bs, repeats=2 if not quick else 1)
        res["timing_validation"][f"b{bs}"] = {k: v["tokens_per_s"] for k, v in tv.items()}
        fastest = {}
        for k in GRIDS:
            opts = [(tv[f"{LABELS[k]}@{g}"]["tokens_per_s"], g) for g in gammas if g in best[k]]
            if opts:
                fastest[LABELS[k]] = max(opts)[1]
        res["fastest_gamma"][f"b{bs}"] = fastest
        log(f"  fastest gamma: {fastest}")
        methods = [Method("target_only", None)] + [
            Method(LABELS[k], rule_of(k, best[k][fastest[LABELS[k]]]), fastest[LABELS[k]]) for k in GRIDS
            if LABELS[k] in fastest]
        log(f"batch {bs}: {repeats} interleaved repeats on test ...")
        n_t = n_test if bs > 1 else min(n_test, N_TEST_B1)  # batch 1 is slow: a prefix of the test split
        tt = interleaved_timing(methods, target, draft, test_p[:n_t], max_tokens, stop, bs, repeats, progress=log)
        res["test"][f"b{bs}"] = {m.name: {"gamma": m.gamma, "threshold": None if m.rule is None else m.rule.threshold,
                                          "problems": n_t, "tokens_per_s": tt[m.name]["tokens_per_s"],
                                          "tokens_per_s_repeats": tt[m.name]["tokens_per_s_all"],
                                          **summarize(tok, test[:n_t], tt[m.name]["outs"], ref_test[:n_t])}
                                 for m in methods}

    log(f"MAT at equal gamma {REF_GAMMA} on test ...")
    eq = {}
    g_eq = REF_GAMMA if REF_GAMMA in gammas else gammas[-1]
    for k in GRIDS:
        if g_eq in best[k]:
            outs = Method(k, rule_of(k, best[k][g_eq]), g_eq).run(target, draft, test_p, max_tokens, stop, 16)
            eq[LABELS[k]] = {"gamma": g_eq, "threshold": best[k][g_eq], **summarize(tok, test, outs, ref_test)}
    res["test_equal_gamma"] = eq

    # post hoc, NOT used for any selection: the whole threshold grid on the test split at the
    # reference gamma (shows whether any threshold would have met the criteria on test)
    log(f"post-hoc test sweep at gamma {g_eq} ...")
    test_sweep = []
    for name, grid in GRIDS.items():
        test_sweep += [point(f"test:{key_base}:{n_test}:{name}:{thr}:{g_eq}", name, thr, g_eq, test_p, test, ref_test)
                       for thr in grid]
        save_cache()
    res["test_sweep_post_hoc"] = test_sweep

    # headline table: for each method, MAT/accuracy at equal gamma, tokens/s at its fastest gamma
    head_bs = f"b{batch_sizes[0]}"
    methods_out = {"target_only": {"mat": 1.0, "accuracy": res["test"][head_bs]["target_only"]["accuracy"],
                                   "mean_tokens": res["test"][head_bs]["target_only"]["tokens"] / n_test,
                                   "tokens_per_s": res["test"][head_bs]["target_only"]["tokens_per_s"]}}
    for k in GRIDS:
        lab = LABELS[k]
        if lab not in eq or lab not in res["test"][head_bs]:
            continue
        t = res["test"][head_bs][lab]
        methods_out[lab] = {"mat": eq[lab]["mat"], "accuracy": eq[lab]["accuracy"], "agreement": eq[lab]["agreement"],
                            "threshold": eq[lab]["threshold"], "gamma_for_mat": g_eq,
                            "tokens_per_s": t["tokens_per_s"], "gamma_for_speed": t["gamma"],
                            "threshold_at_speed_gamma": t["threshold"], "accuracy_at_speed_gamma": t["accuracy"],
                            "mat_at_speed_gamma": t["mat"]}
        for bs in batch_sizes[1:]:
            if lab in res["test"][f"b{bs}"]:
                methods_out[lab][f"tokens_per_s_b{bs}"] = res["test"][f"b{bs}"][lab]["tokens_per_s"]
    for bs in batch_sizes[1:]:
        methods_out["target_only"][f"tokens_per_s_b{bs}"] = res["test"][f"b{bs}"]["target_only"]["tokens_per_s"]
    res["methods"] = methods_out
    res["headline_batch_size"] = batch_sizes[0]
    v, kl = methods_out.get("vanilla"), methods_out.get("kl_judge")
    if v and kl:
        crit = {"mat_ratio": kl["mat"] / v["mat"], "accuracy_drop_points": 100 * (v["accuracy"] - kl["accuracy"]),
                "tokens_per_s_ratio": kl["tokens_per_s"] / v["tokens_per_s"]}
        for bs in batch_sizes[1:]:
            crit[f"tokens_per_s_ratio_b{bs}"] = kl[f"tokens_per_s_b{bs}"] / v[f"tokens_per_s_b{bs}"]
        for bs in batch_sizes:  # the same ratio repeat by repeat (both timed within one repeat), then the median
            t = res["test"][f"b{bs}"]
            crit[f"tokens_per_s_ratio_paired_median_b{bs}"] = statistics.median(
                a / b for a, b in zip(t["kl_judge"]["tokens_per_s_repeats"], t["vanilla"]["tokens_per_s_repeats"]))
            crit[f"kl_vs_target_only_b{bs}"] = t["kl_judge"]["tokens_per_s"] / t["target_only"]["tokens_per_s"]
            crit[f"vanilla_vs_target_only_b{bs}"] = t["vanilla"]["tokens_per_s"] / t["target_only"]["tokens_per_s"]
        crit["mat_ge_1.5x"] = crit["mat_ratio"] >= 1.5
        crit["accuracy_within_1_point"] = crit["accuracy_drop_points"] <= 1.0 + 1e-9
        crit["tokens_per_s_ge_1.3x"] = crit["tokens_per_s_ratio"] >= 1.3
        res["criteria"] = crit
    res["seconds"] = time.time() - t_start
    (out_dir / "kl_judge.json").write_text(json.dumps(res, indent=1))
    (out_dir / "kl_judge.md").write_text(markdown(res))
    frontier_plot(res, out_dir / "kl_judge_frontier.png")
    return res


def markdown(res: dict) -> str:
    L = ["# KL-judge speculative decoding on the testbed", "",
         "Generated by `.venv/bin/python benchmarks/kl_judge.py` (see `setup` in kl_judge.json). " + res["setup"]["task"] + ".",
         f"MAT: {res['setup']['mat_definition']}. Thresholds/gammas chosen on validation "
         f"({res['setup']['validation_problems']}), numbers below on test ({res['setup']['test_problems']}).", ""]
    hb = res["headline_batch_size"]
    L += [f"## Headline (MAT and accuracy at gamma {res['setup']['ref_gamma_for_mat']}; tokens/s at each method's "
          f"fastest gamma, batch {hb})", "",
          "| method | threshold | MAT | accuracy | agreement w/ target | tokens/s | fastest gamma | other batch sizes tokens/s |",
          "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, m in res["methods"].items():
        others = ", ".join(f"{k[len('tokens_per_s_'):]}: {v:.0f}" for k, v in m.items() if k.startswith("tokens_per_s_b"))
        L.append(f"| {name} | {m.get('threshold', '')} | {m['mat']:.2f} | {m['accuracy']:.3f} | "
                 f"{m.get('agreement', 1.0):.3f} | {m['tokens_per_s']:.0f} | {m.get('gamma_for_speed', '')} | {others} |")
    if "criteria" in res:
        c = res["criteria"]
        L += ["", "## Issue 7 criteria (KL judge vs vanilla, same run)", "",
              f"- MAT ratio at gamma {res['setup']['ref_gamma_for_mat']}: {c['mat_ratio']:.2f} (>= 1.5: {c['mat_ge_1.5x']})",
              f"- accuracy drop: {c['accuracy_drop_points']:.2f} points (<= 1: {c['accuracy_within_1_point']})",
              f"- tokens/s ratio, batch {hb}: {c['tokens_per_s_ratio']:.2f} (>= 1.3: {c['tokens_per_s_ge_1.3x']})"]
        L += [f"- {k}: {v:.2f}" for k, v in c.items()
              if k.startswith(("tokens_per_s_ratio_b", "tokens_per_s_ratio_paired", "kl_vs_target", "vanilla_vs_target"))]
    if "timing_all_gammas" in res:
        L += ["", "## Tokens/s with every gamma timed in one interleaved run (test split; each method at its fastest "
              "gamma of this run, so vanilla gets its best gamma)", "",
              "| batch | problems | fastest vanilla | fastest KL judge | KL / vanilla (ratio of medians) | KL / vanilla (paired median) | KL / target-only | vanilla / target-only | all configs (median tokens/s) |",
              "|---:|---:|---|---|---:|---:|---:|---:|---|"]
        for bs, t in res["timing_all_gammas"].items():
            allc = ", ".join(f"{k} {v['tokens_per_s']:.0f}" for k, v in t["configs"].items())
            pm = paired_median(t["configs"][t["fastest"]["kl_judge"]]["tokens_per_s_repeats"],
                               t["configs"][t["fastest"]["vanilla"]]["tokens_per_s_repeats"])
            L.append(f"| {bs[1:]} | {t['problems']} | {t['fastest']['vanilla']} | {t['fastest']['kl_judge']} | "
                     f"{t['kl_over_vanilla']:.2f} | {pm:.2f} | {t['kl_over_target_only']:.2f} | {t['vanilla_over_target_only']:.2f} | {allc} |")
    jm = res["judge_mining"]
    m = res["methods"]
    if "kl_judge" in m:
        L += ["", "## Reading these numbers", "",
              f"- The testbed target solves {100 * m['target_only']['accuracy']:.1f}% of the test problems (greedy): "
              "accuracy sits near the floor, so it barely sees answer changes. `agreement` (final answer identical "
              f"to target-only decoding) does: the KL judge at its chosen threshold keeps {100 * m['kl_judge']['agreement']:.1f}% "
              "of the target's answers.",
              "- The task is answer-only (no reasoning text), so every target/draft mismatch is a digit or the end of "
              f"the answer: AutoJudge mining labels {100 * jm['important_fraction']:.1f}% of mismatches important, its "
              "logistic regression degenerates to the constant 'important' classifier and autojudge equals vanilla.",
              f"- Wall clock includes both prefills; answers are {m['target_only'].get('mean_tokens', float('nan')):.1f} tokens on average, "
              "so prefill is a large share and speculative decoding pays the draft prefill on top."]
        if "test_sweep_post_hoc" in res:
            ts = res["test_sweep_post_hoc"]
            v0 = next(r for r in ts if r["rule"] == "standard")
            ok = [r["threshold"] for r in ts if r["rule"] == "kl" and r["mat"] >= 1.5 * v0["mat"]
                  and r["accuracy"] >= v0["accuracy"] - 0.01 - 1e-12]
            L.append(f"- Post hoc (test split, not used for selection): KL thresholds meeting both MAT >= 1.5x vanilla "
                     f"and accuracy within 1 point at gamma {v0['gamma']}: {ok if ok else 'none'}; the threshold chosen "
                     f"on validation is {m['kl_judge']['threshold']}.")
    L += ["", "## AutoJudge label mining", "",
          f"{jm['mismatches']} target/draft mismatches on {jm['problems']} training problems "
          f"({jm['mismatches_per_problem']:.2f} per problem), important fraction {jm['important_fraction']:.3f}, "
          f"{jm['seconds']:.0f} s."]
    L += ["", "## Cost model (median ms per forward, ctx 128, fp32)", "", "| model/batch | lean T=1 | HF T=1 | lean T=5 | HF T=5 | max logit diff |",
          "|---|---:|---:|---:|---:|---:|"]
    for k, r in res["cost_model"].items():
        if isinstance(r, dict):
            L.append(f"| {k} | {r['lean_T1_ms']:.2f} | {r['hf_T1_ms']:.2f} | {r['lean_T5_ms']:.2f} | {r['hf_T5_ms']:.2f} | "
                     f"{max(r['max_abs_logit_diff_T1'], r['max_abs_logit_diff_T5']):.1e} |")
    L += ["", "## Test, every method at its fastest gamma", ""]
    for bs, rows in res["test"].items():
        L += [f"### batch {bs[1:]}", "", "| method | gamma | threshold | problems | MAT | accuracy | agreement | accept rate | tokens/s (median) | repeats |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for name, r in rows.items():
            ar = "" if r["accept_rate"] is None else f"{r['accept_rate']:.3f}"
            L.append(f"| {name} | {r['gamma']} | {r['threshold']} | {r['problems']} | {r['mat']:.2f} | {r['accuracy']:.3f} | {r['agreement']:.3f} | "
                     f"{ar} | {r['tokens_per_s']:.0f} | {', '.join(f'{x:.0f}' for x in r['tokens_per_s_repeats'])} |")
        L.append("")
    if "test_sweep_post_hoc" in res:
        L += [f"## Test split, every threshold at gamma {res['test_sweep_post_hoc'][0]['gamma']} (post hoc, not used "
              "for selection)", "", "| rule | threshold | MAT | accuracy | agreement |", "|---|---:|---:|---:|---:|"]
        L += [f"| {r['rule']} | {r['threshold']} | {r['mat']:.2f} | {r['accuracy']:.3f} | {r['agreement']:.3f} |"
              for r in res["test_sweep_post_hoc"]]
        L.append("")
    L += ["## Validation sweep (MAT / accuracy / agreement)", "", "| rule | threshold | " +
          " | ".join(f"gamma {g}" for g in res["setup"]["gammas"]) + " |", "|---|---:|" + "---|" * len(res["setup"]["gammas"])]
    for rule, grid in GRIDS.items():
        for thr in grid:
            cells = []
            for g in res["setup"]["gammas"]:
                r = next((r for r in res["sweep_validation"] if r["rule"] == rule and r["threshold"] == thr and r["gamma"] == g), None)
                cells.append("" if r is None else f"{r['mat']:.2f} / {r['accuracy']:.3f} / {r['agreement']:.2f}")
            L.append(f"| {rule} | {thr} | " + " | ".join(cells) + " |")
    L += ["", f"Total benchmark time {res['seconds']:.0f} s.", ""]
    return "\n".join(L)


class FrontierPlot:
    """MAT-accuracy (and MAT-agreement) frontier per rule at the reference gamma; owns its Axes."""

    def __init__(self, res: dict):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.fig, self.axes = plt.subplots(1, 3, figsize=(16, 4.4))
        g = res["setup"]["ref_gamma_for_mat"] if res["setup"]["ref_gamma_for_mat"] in res["setup"]["gammas"] else res["setup"]["gammas"][-1]
        panels = [("sweep_validation", "accuracy", "validation accuracy (exact answer)"),
                  ("test_sweep_post_hoc", "accuracy", "test accuracy (post hoc, all thresholds)"),
                  ("sweep_validation", "agreement", "validation answer agreement with target-only")]
        for ax, (src, key, ylab) in zip(self.axes, panels):
            for rule in GRIDS:
                rows = [r for r in res.get(src, []) if r["rule"] == rule and r["gamma"] == g]
                rows.sort(key=lambda r: r["mat"])
                style = "k*" if rule == "standard" else "o-"
                ax.plot([r["mat"] for r in rows], [r[key] for r in rows], style, label=LABELS[rule], ms=8 if rule == "standard" else 4)
            ax.set_xlabel(f"MAT (tokens per target forward, gamma {g})")
            ax.set_ylabel(ylab)
            ax.grid(alpha=0.3)
        self.axes[0].legend(fontsize=8)
        self.fig.suptitle("MAT-accuracy frontier per rule (threshold sweep, held-out arithmetic, greedy)")
        self.fig.tight_layout()

    def save(self, path) -> None:
        self.fig.savefig(path, dpi=110)


def frontier_plot(res: dict, path) -> None:
    FrontierPlot(res).save(path)


def paired_median(a: list[float], b: list[float]) -> float:
    """Median over repeats of a[r] / b[r] (both timed within repeat r, so a load change between
    repeats cancels; the ratio of the two medians does not have that property)."""
    return statistics.median(x / y for x, y in zip(a, b))


def timing_all_gammas(json_path, device: str = "cpu", batch_sizes=(16, 1), repeats: int = 5, n_b1: int = 100,
                      log=print) -> dict:
    """Re-time target-only, vanilla and the KL judge (its selected threshold at each gamma) at EVERY
    gamma in one interleaved run on the test split, and compare each at its fastest gamma of THIS
    run (so a noisy validation timing cannot hand vanilla a slow gamma). Updates the results JSON
    (key timing_all_gammas, criteria *_best_gamma_*) and the markdown next to it."""
    import json
    from pathlib import Path

    from verinfer.models.corpus import heldout_problems
    from verinfer.models.testbed import DRAFT_DIR, TARGET_DIR, load_tokenizer

    torch.set_num_threads(1)
    json_path = Path(json_path)
    res = json.loads(json_path.read_text())
    tok = load_tokenizer()
    target = LlamaLM.from_pretrained(TARGET_DIR, device=device)
    draft = LlamaLM.from_pretrained(DRAFT_DIR, device=device)
    stop = newline_tokens(tok)
    n_test = 100 if res["setup"]["quick"] else 700
    test = heldout_problems(1000)[300 : 300 + n_test]
    test_p = [tok.encode(q, add_special_tokens=False) for q, _ in test]
    sel = res["selected_threshold"]
    out = {}
    for bs in batch_sizes:
        n = n_test if bs > 1 else min(n_test, n_b1)
        methods = [Method("target_only", None)]
        for g in res["setup"]["gammas"]:
            methods.append(Method(f"vanilla@{g}", Rule("standard"), g))
            if str(g) in sel["kl_judge"] or g in sel["kl_judge"]:
                methods.append(Method(f"kl_judge@{g}", Rule("kl", sel["kl_judge"].get(str(g), sel["kl_judge"].get(g))), g))
        log(f"batch {bs}: {len(methods)} configurations x {repeats} interleaved repeats on {n} test problems ...")
        tt = interleaved_timing(methods, target, draft, test_p[:n], 8, stop, bs, repeats, progress=log)
        rows = {k: {"tokens_per_s": v["tokens_per_s"], "tokens_per_s_repeats": v["tokens_per_s_all"]} for k, v in tt.items()}
        best = {}
        for name in ("vanilla", "kl_judge"):
            cands = [(v["tokens_per_s"], k) for k, v in rows.items() if k.startswith(name + "@")]
            best[name] = max(cands)[1]
        out[f"b{bs}"] = {"problems": n, "configs": rows, "fastest": best,
                         "kl_over_vanilla_paired_median": paired_median(rows[best["kl_judge"]]["tokens_per_s_repeats"],
                                                                         rows[best["vanilla"]]["tokens_per_s_repeats"]),
                         "kl_over_vanilla": rows[best["kl_judge"]]["tokens_per_s"] / rows[best["vanilla"]]["tokens_per_s"],
                         "kl_over_target_only": rows[best["kl_judge"]]["tokens_per_s"] / rows["target_only"]["tokens_per_s"],
                         "vanilla_over_target_only": rows[best["vanilla"]]["tokens_per_s"] / rows["target_only"]["tokens_per_s"]}
        res.setdefault("criteria", {})[f"tokens_per_s_ratio_best_gamma_b{bs}"] = out[f"b{bs}"]["kl_over_vanilla"]
        log(f"  fastest {best}, KL/vanilla {out[f'b{bs}']['kl_over_vanilla']:.2f}")
    res["timing_all_gammas"] = out
    json_path.write_text(json.dumps(res, indent=1))
    (json_path.with_suffix(".md")).write_text(markdown(res))
    return out
