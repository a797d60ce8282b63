"""Can speculative decoding beat plain decoding on SmolLM2-135M-Instruct here? The measurements that
decide it, before the full KL-judge benchmark (benchmarks/kl_judge.py --task nextline) is run:

    .venv/bin/python -m benchmarks.kl_judge_feasibility [--n-speed 32] [--repeats 2]
    .venv/bin/python -m benchmarks.kl_judge_feasibility --task multiline --n-speed 8   # the feature-level head

1. the target's greedy accuracy on the next-line task's validation split (spec_tasks.nextline_task),
   for the `given` tokens of the line the task puts in the prompt (4, the task's, and 6);
2. batch-1 tokens/s of target-only decoding, standard speculative decoding with the distilled draft
   (gamma 3, 4, 6), n-gram prompt lookup (min_n 1, max_n 5, gamma 4) and the KL judge (threshold
   0.5, gamma 4), interleaved repeats on the first validation problems, with MAT (bonus token
   counted), acceptance and agreement with target-only decoding;
3. where a batch-1 call's time goes (prefill vs decode steps, target vs draft: kl_judge_bench.time_breakdown).
Writes benchmarks/results/kl_judge_feasibility.{json,md}. --task multiline (the decode-heavy task,
spec_tasks.multiline_task): the same with the feature-level draft head (standard at gamma 3, 4, 6, with its
FR-Spec rows, the KL judge at 0.5 and 2.0) beside the separate draft and n-gram lookup, the head's acceptance
per draft position; writes kl_judge_feasibility_multiline.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.markdown import write_markdown
from benchmarks.kl_judge_bench import Method, interleaved_timing, method_for, summarize, time_breakdown  # noqa: E402
from benchmarks.spec_tasks import NEXTLINE_CONTEXT, multiline_task, nextline_task  # noqa: E402
from verinfer.io import atomic_write_json  # noqa: E402
from verinfer.speculative.decoder import autoregressive  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-speed", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--task", choices=["nextline", "multiline"], default="nextline")
    ap.add_argument("--confidence", type=float, nargs="*", default=[],
                    help="multiline: also time the draft models with these dynamic draft lengths (draft_confidence)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    task = nextline_task() if a.task == "nextline" else multiline_task()
    target, draft = task.models()
    head = task.head(target)
    res: dict = {"command": "benchmarks/kl_judge_feasibility.py " + " ".join(sys.argv[1:]), "setup": task.setup,
                 "threads": 1, "dtype": "bf16", "accuracy_by_given": {}}
    from verinfer.models import multiline, nextline

    mod = nextline if a.task == "nextline" else multiline
    for given in (4, 6):
        val, _ = mod.splits(task.tokenizer, len(task.val), 0, context=NEXTLINE_CONTEXT, given=given)
        outs = autoregressive(target, [list(p.prompt_ids) for p in val], task.max_tokens, stop_token_ids=task.stop,
                              batch_size=16)
        if a.task == "nextline":
            sc = [float(nextline.correct(task.tokenizer, p, o.output_token_ids)) for p, o in zip(val, outs)]
        else:
            sc = [multiline.score(task.tokenizer, p, o.output_token_ids) for p, o in zip(val, outs)]
        res["accuracy_by_given"][given] = {"problems": len(val), "correct": sum(sc), "accuracy": sum(sc) / len(val),
                                           "tokens_per_problem": sum(len(o.output_token_ids) for o in outs) / len(val)}
        print(f"given {given}: target accuracy {sum(sc) / len(val):.4f} on {len(val)} validation problems", flush=True)
    n = a.n_speed
    prompts, probs = task.val_prompts[:n], task.val[:n]
    c0 = dict(confidence=0.0)  # every round drafts gamma tokens (the rows committed before the dynamic length)
    methods = [Method("target_only", None)] + [method_for(f"standard@{g}", "standard", 0.0, g, **c0) for g in (3, 4, 6)] + \
        [method_for("ngram@4", "ngram", 1, 4), method_for("kl_judge_0.5@4", "kl", 0.5, 4, **c0)]
    if a.task == "multiline":
        methods = [Method("target_only", None), method_for("standard@4", "standard", 0.0, 4, **c0),
                   method_for("ngram@4", "ngram", 1, 4)]
        methods += [method_for(f"sd_head@{g}", "head_standard", 0.0, g, head=head, **c0) for g in (3, 4, 6)]
        methods += [method_for("sd_head_fr@4", "head_fr", 16384, 4, head=head, head_dir=task.head_dir, **c0)]
        methods += [method_for(f"kl_head_{t}@4", "head_kl", t, 4, head=head, **c0) for t in (0.5, 2.0)]
        if a.confidence:  # the dynamic draft length (kl_judge_bench.DRAFT_CONFIDENCE) at each value given
            for c in a.confidence:
                methods += [method_for(f"standard@4c{c}", "standard", 0.0, 4, confidence=c),
                            method_for(f"sd_head@4c{c}", "head_standard", 0.0, 4, head=head, confidence=c),
                            method_for(f"sd_head_fr@4c{c}", "head_fr", 16384, 4, head=head, head_dir=task.head_dir,
                                       confidence=c)]
    tt = interleaved_timing(methods, target, draft, prompts, task.max_tokens, task.stop, 1, a.repeats, progress=print)
    ref = tt["target_only"]["outs"]
    base = tt["target_only"]["tokens_per_s"]
    res["speed_b1"] = {"problems": n, "repeats": a.repeats, "configs": {}}
    for k, v in tt.items():
        s = summarize(task, probs, v["outs"], ref)
        res["speed_b1"]["configs"][k] = {
            "tokens_per_s": v["tokens_per_s"], "tokens_per_s_repeats": v["tokens_per_s_all"], "vs_target_only":
            v["tokens_per_s"] / base, "mat": s["mat"], "accept_rate": s["accept_rate"], "accuracy": s["accuracy"],
            "agreement": s["agreement"],
            "same_tokens_as_target_only": sum(o.output_token_ids == r.output_token_ids for o, r in zip(v["outs"], ref)),
            "accept_at": [sum(o.accepted_at[k] for o in v["outs"] if len(o.accepted_at) > k)
                          / max(1, sum(o.proposed_at[k] for o in v["outs"] if len(o.proposed_at) > k))
                          for k in range(max((len(o.proposed_at) for o in v["outs"]), default=0))]}
    res["breakdown_ms_per_problem_b1"] = {
        m.name: time_breakdown(m, target, draft, prompts, task.max_tokens, task.stop, 1)
        for m in methods if m.name in ("target_only", "standard@4", "ngram@4", "sd_head@4", "sd_head_fr@4")}
    res["seconds"] = time.time() - t0
    stem = "kl_judge_feasibility" + ("" if a.task == "nextline" else f"_{a.task}")
    atomic_write_json(a.out / f"{stem}.json", res)
    write_markdown(a.out / f"{stem}.md", markdown(res))
    print(markdown(res))


def markdown(res: dict) -> str:
    L = ["# Speculative decoding on SmolLM2-135M-Instruct: feasibility", "", f"`{res['command']}` (bf16, 1 thread). "
         f"Task: {res['setup']['task']}.", "", "## Target accuracy on the validation split", "",
         "| given tokens of the line | problems | target accuracy | generated tokens / problem |", "|---:|---:|---:|---:|"]
    for g, r in res["accuracy_by_given"].items():
        L.append(f"| {g} | {r['problems']} | {r['accuracy']:.4f} | {r['tokens_per_problem']:.1f} |")
    sp = res["speed_b1"]
    L += ["", f"## Batch 1, first {sp['problems']} validation problems, {sp['repeats']} interleaved repeats", "",
          "MAT counts the target's own token of every round (correction or bonus). Agreement: the generated line equals "
          "target-only decoding's; same tokens: the whole output is identical.", "",
          "| method | tokens/s | vs target-only | MAT | accept rate | accepted at draft position 1, 2, ... | accuracy | "
          "agreement | same tokens |",
          "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for k, r in sp["configs"].items():
        ar = "-" if r["accept_rate"] is None else f"{r['accept_rate']:.3f}"
        at = ", ".join(f"{x:.2f}" for x in r.get("accept_at", []))
        L.append(f"| {k} | {r['tokens_per_s']:.1f} | {r['vs_target_only']:.2f} | {r['mat']:.2f} | {ar} | {at} | "
                 f"{r['accuracy']:.3f} | {r['agreement']:.3f} | {r['same_tokens_as_target_only']} / {sp['problems']} |")
    cols = ["target_prefill_ms", "target_steps_ms", "draft_prefill_ms", "draft_steps_ms", "loop_ms", "total_ms"]
    L += ["", "## Where a batch-1 call's time goes (ms per problem; a speculative method's target prefill is fused "
          "with its first verification)", "", "| method | " + " | ".join(c[:-3].replace("_", " ") for c in cols) + " |",
          "|---|" + "---:|" * len(cols)]
    for k, b in res["breakdown_ms_per_problem_b1"].items():
        L.append(f"| {k} | " + " | ".join(f"{b.get(c, 0.0):.0f}" for c in cols) + " |")
    L += ["", f"Total {res['seconds'] / 60:.1f} min.", ""]
    return "\n".join(L)


if __name__ == "__main__":
    main()
