"""Build the shipped testbed: a byte-level BPE tokenizer, a ~4M-parameter Llama target and a
~0.6M-parameter Llama draft, trained from scratch on CPU (models/corpus.py data).

`build(seed)` is deterministic for a given seed, Python version (the stdlib is the corpus) and
library versions: fixed torch seed, 2 threads, data order from the seed, fixed step counts
(sized from measured speed, not timed, so every machine trains the same steps). It writes

    out_dir/tokenizer/            tokenizer (PreTrainedTokenizerFast save_pretrained)
    out_dir/target/, out_dir/draft/   LlamaForCausalLM save_pretrained (safetensors, fp32) + tokenizer
    out_dir/MODEL_CARD.md, out_dir/build_info.json

Training checkpoints every few minutes to out_dir/.ckpt (safetensors + json), so an interrupted
build resumes bit-exactly; the checkpoints are deleted at the end.

CLI: ``verinfer testbed build --seed 0``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from verinfer.progress import ProgressBar
from verinfer.io import atomic_save_safetensors, atomic_write_json
from verinfer.models import corpus

TESTBED_DIR = Path(__file__).parent / "testbed"
TARGET_DIR = TESTBED_DIR / "target"
DRAFT_DIR = TESTBED_DIR / "draft"
TOKENIZER_DIR = TESTBED_DIR / "tokenizer"

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
VOCAB_SIZE = 2048
SEQ_LEN = 256
ARCH_MAX_POS = 512
THREADS = 2
CKPT_EVERY_S = 180.0

ARCH = {
    "target": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                   intermediate_size=688, tie_word_embeddings=False),
    "draft": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=344, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class Budget:
    """How much to train. Step counts are fixed (not timed) so builds are reproducible."""

    max_bytes: int            # of stdlib source
    n_problems: int           # training arithmetic problems
    batch_size: int           # sequences of SEQ_LEN tokens per step
    target_steps: int
    draft_steps: int
    warmup_steps: int
    target_lr: float
    draft_lr: float
    eval_problems: int        # held-out arithmetic problems for accuracy
    eval_windows: int | None  # held-out loss windows per kind (None: all held-out text)
    threads: int = THREADS    # torch intra-op threads (results can depend on it)


# "full": measured on 2 idle cores (torch 2.13 CPU, fp32, batch 8 x 256, which gave the most
# tokens/s): target 0.26 s/step, draft 0.063 s/step -> 7.7 + 1.5 minutes of training, 9.5 minutes
# for the whole build (seed 0). Other load on the cores stretches this, more than proportionally.
BUDGETS = {
    "full": Budget(max_bytes=corpus.DEFAULT_MAX_BYTES, n_problems=corpus.N_TRAIN_PROBLEMS, batch_size=8,
                   target_steps=1800, draft_steps=1400, warmup_steps=100, target_lr=2e-3, draft_lr=3e-3,
                   eval_problems=200, eval_windows=None),
    "tiny": Budget(max_bytes=200_000, n_problems=1000, batch_size=2, target_steps=2, draft_steps=2,
                   warmup_steps=1, target_lr=1e-3, draft_lr=1e-3, eval_problems=5, eval_windows=2,
                   threads=1),  # 1 thread: a test must not stall on busy cores
}


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(docs: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE (digits split one per token) trained on `docs`, wrapped as a
    transformers PreTrainedTokenizerFast with bos/eos/pad set. No special tokens are added
    automatically when encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    bos, eos, pad = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   model_max_length=ARCH_MAX_POS, clean_up_tokenization_spaces=False)


def save_tokenizer(tokenizer, d: Path) -> None:
    """save_pretrained, naming the class `PreTrainedTokenizerFast` (transformers 5 writes its
    new alias `TokenizersBackend`, which transformers 4 cannot load; both load the former)."""
    tokenizer.save_pretrained(str(d))
    cfg_p = Path(d) / "tokenizer_config.json"
    cfg = json.loads(cfg_p.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_p.write_text(json.dumps(cfg, indent=2) + "\n")


def encode_docs(tokenizer, docs: list[str]) -> torch.Tensor:
    """One int64 token stream: each document's tokens followed by <|eos|>."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- models

def make_model(name: str, tokenizer, seed: int):
    """A freshly initialised LlamaForCausalLM ('target' or 'draft'), fp32, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if name not in ARCH:
        raise ValueError(f"model name must be one of {list(ARCH)}, got {name!r}")
    cfg = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=ARCH_MAX_POS, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, **ARCH[name])
    cfg.verinfer_name = f"verinfer-testbed-{name}"
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def n_params(model) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def lr_at(step: int, peak: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warmup to `peak`, then cosine decay to `floor * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def window_order(n_tokens: int, n_windows: int, seed: int) -> torch.Tensor:
    """Start offsets of `n_windows` training windows (SEQ_LEN+1 tokens, stride SEQ_LEN), in an
    order fixed by `seed`: successive seeded permutations of all windows (epochs)."""
    total = (n_tokens - 1) // SEQ_LEN
    if total < 1:
        raise ValueError(f"corpus too small: {n_tokens} tokens for windows of {SEQ_LEN + 1}")
    g = torch.Generator().manual_seed(seed)
    epochs = [torch.randperm(total, generator=g) for _ in range(-(-n_windows // total))]
    return torch.cat(epochs)[:n_windows] * SEQ_LEN


# ----------------------------------------------------------------------------- checkpoints

def _save_ckpt(path: Path, key: dict, step: int, model, opt, losses: list[float]) -> None:
    tensors = {f"model.{n}": p.detach().contiguous() for n, p in model.named_parameters()}
    sd = opt.state_dict()
    for i, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"opt.{i}.{k}"] = v.detach().contiguous()
    atomic_save_safetensors(tensors, path / f"{key['name']}.safetensors")
    atomic_write_json(path / f"{key['name']}.json",
                      {"key": key, "step": step, "param_groups": sd["param_groups"], "losses": losses}, indent=None)


def _load_ckpt(path: Path, key: dict, model, opt) -> tuple[int, list[float]]:
    """Restore model and optimizer from a matching checkpoint; return (step, losses so far)
    ((0, []) if there is none)."""
    meta_p, st_p = path / f"{key['name']}.json", path / f"{key['name']}.safetensors"
    if not (meta_p.is_file() and st_p.is_file()):
        return 0, []
    meta = json.loads(meta_p.read_text())
    if meta.get("key") != key:
        return 0, []
    tensors = load_file(str(st_p))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tensors[f"model.{n}"])
    state: dict = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, i, name = k.split(".", 2)
            state.setdefault(int(i), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return int(meta["step"]), list(meta["losses"])


# ----------------------------------------------------------------------------- training

def fit(model, steps: int, batch_loss: Callable[[int], torch.Tensor], *, lr: float, warmup: int,
        ckpt_dir: Path | None = None, ckpt_key: dict | None = None, progress: bool = True,
        desc: str = "train") -> list[float]:
    """The training loop of every model built here: AdamW (wd 0.1 on matrices, betas 0.9/0.95),
    linear warmup + cosine (lr_at), grad clip 1.0; batch_loss(step) is the loss of step's batch.
    Checkpoints (model + optimizer + losses) every CKPT_EVERY_S seconds and at the end, and resumes
    from a matching one. Returns the per-step training losses."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    start, losses = _load_ckpt(ckpt_dir, ckpt_key, model, opt) if ckpt_dir and ckpt_key else (0, [])
    rep = ProgressBar(desc, steps, start=start, enabled=progress, fields={"loss": float("nan")})
    last_ckpt = time.perf_counter()
    model.train()
    try:
        for step in range(start, steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, lr, warmup, steps)
            loss = batch_loss(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            rep.update(step + 1, loss=losses[-1])
            if ckpt_dir and ckpt_key and (time.perf_counter() - last_ckpt >= CKPT_EVERY_S or step + 1 == steps):
                _save_ckpt(ckpt_dir, ckpt_key, step + 1, model, opt, losses)
                last_ckpt = time.perf_counter()
    finally:
        rep.close()
    model.eval()
    return losses


def train(model, stream: torch.Tensor, *, steps: int, batch_size: int, lr: float, warmup: int, seed: int,
          ckpt_dir: Path | None = None, ckpt_key: dict | None = None, progress: bool = True,
          desc: str = "train") -> list[float]:
    """`fit` with next-token CE on windows drawn from `stream` in the seeded order."""
    starts = window_order(len(stream), steps * batch_size, seed)
    offs = torch.arange(SEQ_LEN + 1)

    def batch_loss(step: int) -> torch.Tensor:
        batch = stream[starts[step * batch_size:(step + 1) * batch_size, None] + offs]
        logits = model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    return fit(model, steps, batch_loss, lr=lr, warmup=warmup, ckpt_dir=ckpt_dir, ckpt_key=ckpt_key,
               progress=progress, desc=desc)


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, max_windows: int | None = None, batch_size: int = 16) -> tuple[float, int]:
    """(mean next-token CE, tokens scored) over consecutive SEQ_LEN+1 windows (stride SEQ_LEN) of
    `stream`; with `max_windows`, that many windows evenly spread over it."""
    model.eval()
    if len(stream) < 2:
        return float("nan"), 0  # nothing to score
    if len(stream) <= SEQ_LEN:  # tiny builds: one short window
        logits = model(input_ids=stream[None, :-1]).logits[0]
        return F.cross_entropy(logits, stream[1:]).item(), len(stream) - 1
    n = (len(stream) - 1) // SEQ_LEN
    idx = torch.arange(n) if max_windows is None or max_windows >= n else torch.linspace(0, n - 1, max_windows).long()
    starts, offs = idx * SEQ_LEN, torch.arange(SEQ_LEN + 1)
    total, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        batch = stream[starts[i:i + batch_size, None] + offs]
        logits = model(input_ids=batch[:, :-1]).logits
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count, count


def greedy_fn(model, tokenizer, max_new_tokens: int = 8) -> Callable[[str], str]:
    """question text -> greedy continuation text, via HF generate(do_sample=False)."""

    @torch.no_grad()
    def gen(text: str) -> str:
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    return gen


def evaluate(model, tokenizer, code_stream: torch.Tensor, arith_stream: torch.Tensor, budget: Budget) -> dict:
    """Held-out loss (all, code, arithmetic) and greedy arithmetic accuracy."""
    lc, nc = heldout_loss(model, code_stream, budget.eval_windows)
    la, na = heldout_loss(model, arith_stream, budget.eval_windows)
    acc = corpus.arithmetic_accuracy(greedy_fn(model, tokenizer), corpus.heldout_problems(budget.eval_problems))
    if nc + na == 0:
        raise ValueError("no held-out tokens to score")
    both = [(l, n) for l, n in ((lc, nc), (la, na)) if n]
    return {"heldout_loss": sum(l * n for l, n in both) / (nc + na),
            "heldout_loss_code": lc if nc else None, "heldout_loss_arith": la if na else None,
            "heldout_tokens": nc + na, "arith_accuracy": acc, "arith_problems": budget.eval_problems}


# ----------------------------------------------------------------------------- build

def _save_model(model, tokenizer, d: Path) -> None:
    if d.exists():
        shutil.rmtree(d)
    model.save_pretrained(str(d), safe_serialization=True)
    save_tokenizer(tokenizer, d)
    for f in d.iterdir():  # save_pretrained may create owner-only files
        f.chmod(0o644)
    if list(d.glob("*.bin")) or not (d / "model.safetensors").is_file():
        raise RuntimeError(f"{d}: expected a single model.safetensors and no *.bin")


def _sha16(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16]


def build(seed: int, out_dir: Path = TESTBED_DIR, *, budget: str = "full", progress: bool = True) -> dict:
    """Train the tokenizer, target and draft from `seed` into `out_dir`; evaluate; write
    MODEL_CARD.md and build_info.json; return the build info dict."""
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {list(BUDGETS)}, got {budget!r}")
    b = BUDGETS[budget]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(b.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(THREADS))
    try:
        return _build(seed, out_dir, b, budget, progress)
    finally:
        torch.set_num_threads(threads_before)


def _build(seed: int, out_dir: Path, b: Budget, budget: str, progress: bool) -> dict:
    ckpt_dir = out_dir / ".ckpt"
    t0 = time.perf_counter()
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    train_docs, held_docs = corpus.corpus_documents(seed, b.max_bytes, b.n_problems)
    tokenizer = train_tokenizer(train_docs)
    tok_dir = out_dir / "tokenizer"
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    save_tokenizer(tokenizer, tok_dir)
    stream = encode_docs(tokenizer, train_docs)
    n_held_files = len(corpus.stdlib_split(b.max_bytes)[1])
    code_stream = encode_docs(tokenizer, held_docs[:n_held_files])
    arith_stream = encode_docs(tokenizer, held_docs[n_held_files:])
    log(f"corpus: {len(stream):,} training tokens, {len(code_stream) + len(arith_stream):,} held-out tokens, "
        f"tokenizer vocab {len(tokenizer)} ({time.perf_counter() - t0:.0f}s)")

    tok_hash = _sha16(tok_dir / "tokenizer.json")
    results = {}
    for name, steps, lr in (("target", b.target_steps, b.target_lr), ("draft", b.draft_steps, b.draft_lr)):
        t1 = time.perf_counter()
        model = make_model(name, tokenizer, seed)
        key = {"name": name, "seed": seed, "budget": asdict(b), "tokenizer": tok_hash, "stream": len(stream),
               "torch": torch.__version__}
        losses = train(model, stream, steps=steps, batch_size=b.batch_size, lr=lr, warmup=b.warmup_steps,
                       seed=seed, ckpt_dir=ckpt_dir, ckpt_key=key, progress=progress, desc=name)
        t_train = time.perf_counter() - t1
        _save_model(model, tokenizer, out_dir / name)
        ev = evaluate(model, tokenizer, code_stream, arith_stream, b)
        results[name] = {"parameters": n_params(model), "train_steps": steps,
                         "train_tokens": steps * b.batch_size * SEQ_LEN, "batch_size": b.batch_size,
                         "seq_len": SEQ_LEN, "peak_lr": lr,
                         "final_train_loss": (sum(losses[-20:]) / len(losses[-20:])) if losses else None,
                         **ev, "train_seconds": round(t_train, 1),
                         "weights_sha256": _sha16(out_dir / name / "model.safetensors"), **ARCH[name]}
        log(f"{name}: {results[name]['parameters']:,} params, held-out loss {ev['heldout_loss']:.4f}, "
            f"arithmetic {ev['arith_accuracy']:.3f} ({time.perf_counter() - t1:.0f}s)")

    shutil.rmtree(ckpt_dir, ignore_errors=True)
    import tokenizers
    import transformers

    info = {
        "seed": seed, "budget": budget, "command": f"verinfer testbed build --seed {seed}"
        + ("" if budget == "full" else f" --budget {budget}"),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__, "threads": b.threads,
        "vocab_size": len(tokenizer), "tokenizer_sha256": tok_hash,
        "corpus": {"train_tokens_available": len(stream), "heldout_tokens": len(code_stream) + len(arith_stream),
                   "stdlib_max_bytes": b.max_bytes, "train_problems": b.n_problems,
                   "heldout_file_percent": corpus.HELDOUT_FILE_PERCENT,
                   "heldout_problems": corpus.N_HELDOUT_PROBLEMS},
        "models": results, "build_seconds": round(time.perf_counter() - t0, 1),
    }
    (out_dir / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    (out_dir / "MODEL_CARD.md").write_text(model_card(info))
    return info


CARD_ROWS = (  # (label, key in models[name], format)
    ("Parameters", "parameters", "{:,}"),
    ("Training tokens", "train_tokens", "{:,}"),
    ("Training steps", "train_steps", "{:,}"),
    ("Held-out loss (nats/token)", "heldout_loss", "{:.4f}"),
    ("Held-out loss, code", "heldout_loss_code", "{:.4f}"),
    ("Held-out loss, arithmetic", "heldout_loss_arith", "{:.4f}"),
    ("Arithmetic accuracy (greedy)", "arith_accuracy", "{:.3f}"),
)


def model_card(info: dict) -> str:
    """MODEL_CARD.md text for a build_info dict."""
    m = info["models"]
    cell = lambda v, fmt: "n/a" if v is None else fmt.format(v)  # noqa: E731
    rows = [f"| {label} | {cell(m['target'][k], fmt)} | {cell(m['draft'][k], fmt)} |" for label, k, fmt in CARD_ROWS]
    arch = [f"| {n} | {a['hidden_size']} | {a['num_hidden_layers']} | {a['num_attention_heads']} | "
            f"{a['num_key_value_heads']} | {a['intermediate_size']} | {'yes' if a['tie_word_embeddings'] else 'no'} |"
            for n, a in m.items()]
    c = info["corpus"]
    return "\n".join([
        "# verinfer testbed models", "",
        "Two small Llama models (`LlamaForCausalLM`, fp32 safetensors) and their tokenizer, trained from",
        "scratch on CPU so verinfer's audits, batching and speculative decoding run without a model hub.",
        "They are test fixtures, not useful language models.", "",
        "| | target | draft |", "|---|---:|---:|", *rows, "",
        f"Held-out loss is the mean next-token cross-entropy over {m['target']['heldout_tokens']:,} held-out tokens",
        f"(code and arithmetic, windows of {SEQ_LEN}). Arithmetic accuracy: greedy continuation (HF",
        f"`generate(do_sample=False)`) of {m['target']['arith_problems']} held-out problems starts with the",
        "right answer followed by a non-digit.", "",
        "## Architecture", "",
        "| model | hidden | layers | heads | kv heads | MLP | tied embeddings |", "|---|---:|---:|---:|---:|---:|---|",
        *arch, "",
        f"Vocabulary {info['vocab_size']} (byte-level BPE, digits split one per token; special tokens",
        "`<|bos|>`, `<|eos|>`, `<|pad|>`; nothing is added automatically when encoding), RoPE theta 10000,",
        f"max positions {ARCH_MAX_POS}, RMSNorm eps 1e-5, SiLU MLP, grouped-query attention.", "",
        "## Data", "",
        f"- Python {info['python']} standard-library source (`*.py` under `sysconfig.get_paths()['stdlib']`,",
        "  without `test`/`tests`/`idlelib`/`site-packages`/`lib2to3` and the machine-specific `_sysconfigdata*`),",
        "  each file prefixed by `# file: <relpath>`. The corpus depends on the Python version used to build.",
        f"- {c['train_problems']:,} synthetic arithmetic problems (`Q: 37+45=\\nA: 82\\n`; +, -, * on 1-3 digit",
        "  numbers) in blocks of 32; documents are separated by `<|eos|>`.",
        f"- Held out (never trained on, independent of the seed): {c['heldout_file_percent']}% of stdlib files by",
        f"  path hash and {c['heldout_problems']} problems from a fixed seed (`verinfer.models.corpus`).",
        f"- {c['train_tokens_available']:,} training tokens available; the models see the numbers of tokens above.", "",
        "## Training", "",
        f"AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warmup then cosine decay to 10%,",
        f"grad clip 1.0, sequence length {SEQ_LEN}, batch {m['target']['batch_size']}, peak lr "
        f"{m['target']['peak_lr']:g} (target) / {m['draft']['peak_lr']:g} (draft);",
        f"`torch.manual_seed({info['seed']})`, {info['threads']} threads, data order from the seed. The draft",
        "trains on the same data order, for fewer steps.", "",
        "## Reproduce", "",
        "```", info["command"], "```", "",
        f"Seed {info['seed']}; built with Python {info['python']}, torch {info['torch']}, transformers "
        f"{info['transformers']}, tokenizers {info['tokenizers']} in {info['build_seconds']:.0f} s.",
        "Numbers are also in `build_info.json`.", "",
    ])
