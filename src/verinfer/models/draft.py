"""Distil a small draft model for a real target, on the target's own tokenizer, for speculative decoding.

Recipe of `verinfer testbed build-draft --model smollm2-135m-instruct --seed 0` (deterministic for a
seed on one machine; every stage resumes from what it already wrote):

  1. data: the stdlib TRAINING files of models/corpus.py (the 5% held-out files, the source of the
     next-line task, are never trained on), each tokenized with the target's tokenizer, joined by its
     document separator, cut into SEQ_LEN+1-token windows in the seed's order (testbed.window_order).
  2. teacher: the target's TOP_K largest next-token log-probabilities (temperature 1) at every position
     of the first `teacher_windows` windows, computed once, in shards of SHARD windows (safetensors).
  3. student: a Llama of DRAFT_ARCH (d 256, 4 layers, GQA 4/2, tied embeddings). Its embedding starts
     as the target's embedding projected on its top-256 right singular vectors (E V_256), so the student
     starts with the target's token geometry instead of noise.
  4. loss: cross-entropy of the student against the teacher's top-k distribution renormalized over those
     k tokens, sum_k p_k * -log q_k (forward KL up to the teacher's entropy); AdamW, warmup + cosine,
     bf16 autocast, checkpoints every few minutes (testbed.fit: an interrupted build resumes).
  5. writes out_dir: save_pretrained (bf16 safetensors) + the target's tokenizer, COUNTS_FILE (how
     often each token id occurs in the training stream: speculative/draft_vocab.py's frequency-ranked
     draft vocabulary), build_info.json and
     MODEL_CARD.md with the measured acceptance against the target on held-out stdlib windows: the
     greedy agreement rate (the per-token acceptance of greedy speculative decoding) and the mean
     sum_v min(p_v, q_v) (the acceptance of standard speculative sampling at temperature 1).
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from verinfer.progress import ProgressBar
from verinfer.io import atomic_save_safetensors, atomic_write_json, atomic_write_text
from verinfer.models import corpus, load
from verinfer.models.llama import read_model_config
from verinfer.models.testbed import SEQ_LEN, fit, window_order

TOP_K = 32
# counts_V of the training stream, beside the weights: JSON, not *.safetensors, which are the weights
# (loaded and hashed as the model)
COUNTS_FILE = "token_counts.json"
SHARD = 64  # teacher windows per shard file
DRAFT_ARCH = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=768, tie_word_embeddings=True)


@dataclass(frozen=True)
class DraftBudget:
    """How much to distil. Counts are fixed (not timed), so every machine trains the same steps."""

    teacher_windows: int  # SEQ_LEN-token windows the target labels (its top-k log-probs)
    epochs: int           # passes of the student over them
    batch_size: int
    lr: float
    warmup_steps: int
    eval_windows: int     # held-out windows for the acceptance figures
    threads: int = 2
    max_bytes: int = corpus.DEFAULT_MAX_BYTES  # of stdlib source (models/corpus.py)

    @property
    def steps(self) -> int:
        return self.epochs * self.teacher_windows // self.batch_size


BUDGETS = {
    # 3,072 windows = 786k teacher tokens, 2 epochs at batch 8
    "full": DraftBudget(teacher_windows=3072, epochs=2, batch_size=8, lr=2e-3, warmup_steps=50, eval_windows=32),
    # 8,192 windows = 2.1M teacher tokens (the first 3,072 are "full"'s: its shards are reused), 3 epochs
    "large": DraftBudget(teacher_windows=8192, epochs=3, batch_size=8, lr=2e-3, warmup_steps=100, eval_windows=32),
    "tiny": DraftBudget(teacher_windows=4, epochs=1, batch_size=2, lr=1e-3, warmup_steps=1, eval_windows=1,
                        threads=1, max_bytes=1_000_000),  # a test's smoke build: seconds
}


# ----------------------------------------------------------------------------- data

def separator_id(tokenizer) -> int:
    """The token between documents: the tokenizer's <|endoftext|> when it has one, else its EOS."""
    tid = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
        return tid
    if tokenizer.eos_token_id is None:
        raise ValueError("the target's tokenizer has neither <|endoftext|> nor an EOS token to separate documents")
    return tokenizer.eos_token_id


def token_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    """Documents tokenized with `tokenizer`, each followed by the separator, as one int64 stream."""
    sep = separator_id(tokenizer)
    ids: list[int] = []
    for d in docs:
        ids += tokenizer.encode(d, add_special_tokens=False) + [sep]
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """[n, SEQ_LEN + 1] training windows of `stream` in the seed's order."""
    starts = window_order(len(stream), n, seed)
    return stream[starts[:, None] + torch.arange(SEQ_LEN + 1)]


def heldout_windows(stream: torch.Tensor, n: int) -> torch.Tensor:
    """[<= n, SEQ_LEN + 1] windows evenly spread over the held-out stream (stride SEQ_LEN)."""
    total = (len(stream) - 1) // SEQ_LEN
    if total < 1:
        raise ValueError(f"the held-out stream has {len(stream)} tokens, fewer than one window of {SEQ_LEN + 1}: "
                         "raise the budget's max_bytes so that held-out stdlib files are included")
    pick = torch.linspace(0, total - 1, min(n, total)).round().long().unique() * SEQ_LEN
    return stream[pick[:, None] + torch.arange(SEQ_LEN + 1)]


def token_counts(stream_T: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """counts_V: occurrences of every token id in a token stream (int64)."""
    if stream_T.numel() and (int(stream_T.min()) < 0 or int(stream_T.max()) >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size}) in the stream: is it tokenized with this vocabulary?")
    return torch.bincount(stream_T.long().flatten(), minlength=vocab_size)


def save_counts(draft_dir: str | Path, counts_V: torch.Tensor) -> Path:
    """Write the training stream's token counts beside a draft's weights (COUNTS_FILE)."""
    path = Path(draft_dir) / COUNTS_FILE
    nz = counts_V.nonzero().flatten().tolist()
    atomic_write_json(path, {"vocab_size": len(counts_V), "tokens": int(counts_V.sum()),
                             "counts": {str(i): int(counts_V[i]) for i in nz}})
    return path


def counts_info(counts_V: torch.Tensor) -> dict:
    """What build_info.json and the model card say about COUNTS_FILE."""
    return {"file": COUNTS_FILE, "stream_tokens": int(counts_V.sum()), "distinct_ids": int((counts_V > 0).sum())}


def load_counts(draft_dir: str | Path) -> torch.Tensor:
    """counts_V of a draft's training stream, from its directory."""
    path = Path(draft_dir) / COUNTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: this draft has no token counts; rebuild it with `verinfer testbed "
                                "build-draft` (which writes them) or draft with the full vocabulary")
    try:
        d = json.loads(path.read_text())
        counts = torch.zeros(int(d["vocab_size"]), dtype=torch.long)
        for i, c in d["counts"].items():
            counts[int(i)] = int(c)
    except (json.JSONDecodeError, KeyError, ValueError, TypeError, IndexError) as e:
        raise ValueError(f"{path}: not a token-counts file ({type(e).__name__}: {e}); rebuild the draft with "
                         "`verinfer testbed build-draft`") from None
    return counts


# ----------------------------------------------------------------------------- teacher

@torch.no_grad()
def teacher_topk(target, tokens_BT: torch.Tensor, k: int = TOP_K) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_BTK float16, idx_BTK int32): the target's k largest next-token log-probabilities at every
    position of tokens_BT (its plain causal forward, temperature 1)."""
    B, T = tokens_BT.shape
    pos = torch.arange(T, device=target.device).expand(B, -1)
    logits_BTV, _ = target(tokens_BT.to(target.device), pos)
    logp, idx = torch.log_softmax(logits_BTV.float(), -1).topk(k, dim=-1)
    return logp.to(torch.float16).cpu(), idx.to(torch.int32).cpu()


def teacher_shards(target, wins_NT: torch.Tensor, work: Path, key: dict, *, k: int = TOP_K, batch: int = 8,
                   progress: bool = True) -> tuple[list[Path], int]:
    """Label every window with the target's top-k log-probs, SHARD windows per safetensors file in
    `work` (`window_shards`). Returns (the shard paths, how many of them this call computed)."""
    def label(w_NT: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = [teacher_topk(target, w_NT[j:j + batch], k) for j in range(0, len(w_NT), batch)]
        return {"logp": torch.cat([p[0] for p in parts]), "idx": torch.cat([p[1] for p in parts])}

    return window_shards(wins_NT, work, key, "teacher", label, "teacher top-k (windows)", shard=SHARD,
                         progress=progress)


def window_shards(wins_NT: torch.Tensor, work: Path, key: dict, name: str, label, desc: str, *,
                  shard: int = SHARD, progress: bool = True) -> tuple[list[Path], int]:
    """label(windows[:, :-1]) -> tensors of every window, `shard` windows per `<name>_NNNNN.safetensors`
    in `work` (with the windows as "tokens"). A shard already there is kept when `key` matches the
    one recorded (`<name>_key.json`) and it holds exactly its windows: the seed's window order is
    prefix-stable, so a larger budget reuses a smaller one's shards. Returns (the shard paths, how
    many of them this call computed)."""
    work.mkdir(parents=True, exist_ok=True)
    key_p = work / f"{name}_key.json"
    if key_p.is_file() and json.loads(key_p.read_text()) != key:
        for p in work.glob(f"{name}_*.safetensors"):
            p.unlink()
    atomic_write_json(key_p, key)
    paths = [work / f"{name}_{i:05d}.safetensors" for i in range(math.ceil(len(wins_NT) / shard))]

    def holds_its_windows(i: int) -> bool:
        if not paths[i].is_file():
            return False
        from safetensors import safe_open

        with safe_open(str(paths[i]), "pt") as st:
            return torch.equal(st.get_tensor("tokens"), wins_NT[i * shard:(i + 1) * shard])

    todo = [i for i in range(len(paths)) if not holds_its_windows(i)]
    bar = ProgressBar(desc, len(wins_NT), start=(len(paths) - len(todo)) * shard, enabled=progress)
    try:
        for i in todo:
            w = wins_NT[i * shard:(i + 1) * shard]
            atomic_save_safetensors({**{k: v.contiguous() for k, v in label(w[:, :-1]).items()},
                                     "tokens": w.contiguous()}, paths[i])
            bar.update(min(len(wins_NT), (i + 1) * shard))
    finally:
        bar.close()
    return paths, len(todo)

def _sha16(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:16]


def work_dir(target_dir: Path, seed: int) -> Path:
    """Where the teacher shards and training checkpoints of a build live (resumable)."""
    from verinfer.models.catalog import cache_dir

    return cache_dir() / "work" / f"{Path(target_dir).name}-draft-seed{seed}"


def streams(tokenizer, max_bytes: int = corpus.DEFAULT_MAX_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """(training stream, held-out stream) of the stdlib split, tokenized with the target's tokenizer."""
    train_docs, held_docs = corpus.stdlib_split(max_bytes)
    return token_stream(tokenizer, train_docs), token_stream(tokenizer, held_docs)


# ----------------------------------------------------------------------------- student

def make_student(target_dir: Path, seed: int, arch: dict | None = None):
    """A LlamaForCausalLM of DRAFT_ARCH on the target's vocabulary, rope and special tokens, fp32,
    seeded; its (tied) embedding is the target's projected on its top right singular vectors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = dict(DRAFT_ARCH, **(arch or {}))
    tc = read_model_config(target_dir)
    cfg = LlamaConfig(vocab_size=tc["vocab_size"], max_position_embeddings=tc["max_position_embeddings"],
                      rms_norm_eps=tc.get("rms_norm_eps", 1e-5),
                      rope_parameters={"rope_type": "default", "rope_theta": float(tc.get("rope_theta", 10000.0))},
                      bos_token_id=tc.get("bos_token_id"), eos_token_id=tc.get("eos_token_id"),
                      pad_token_id=tc.get("pad_token_id"), **arch)
    cfg.verinfer_name = f"{tc.get('verinfer_name', Path(target_dir).name)}-draft"
    torch.manual_seed(seed)
    student = LlamaForCausalLM(cfg).float()
    E_VD = _target_embedding(Path(target_dir))
    _, _, Vh = torch.linalg.svd(E_VD, full_matrices=False)
    with torch.no_grad():
        student.model.embed_tokens.weight.copy_(E_VD @ Vh[: arch["hidden_size"]].T)
    return student


def _target_embedding(d: Path) -> torch.Tensor:
    from safetensors import safe_open

    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in ("model.embed_tokens.weight", "embed_tokens.weight"):
                if name in st.keys():
                    return st.get_tensor(name).float()
    raise FileNotFoundError(f"{d}: no embed_tokens.weight in its safetensors")


def distil_loss(logits_BTV: torch.Tensor, logp_BTK: torch.Tensor, idx_BTK: torch.Tensor) -> torch.Tensor:
    """Mean over positions of sum_k p_k * -log q_k, p = the teacher's top-k renormalized over those k."""
    p_BTK = torch.softmax(logp_BTK.float(), -1)
    logq_BTK = torch.log_softmax(logits_BTV.float(), -1).gather(-1, idx_BTK.long())
    return -(p_BTK * logq_BTK).sum(-1).mean()


def distil(student, shards: list[Path], b: DraftBudget, seed: int, *, ckpt_dir: Path, key: dict,
           progress: bool = True) -> list[float]:
    """Train `student` on the teacher shards (testbed.fit: AdamW, warmup + cosine, grad clip 1,
    checkpoints), bf16 autocast; each epoch's window order is a seeded permutation. Resumes from ckpt_dir."""
    data = [load_file(str(p)) for p in shards]
    tokens = torch.cat([d["tokens"] for d in data])
    logp, idx = torch.cat([d["logp"] for d in data]), torch.cat([d["idx"] for d in data])
    N = len(tokens)
    g = torch.Generator().manual_seed(seed + 1)
    order = torch.cat([torch.randperm(N, generator=g) for _ in range(b.epochs)])
    dev = student.device

    def batch_loss(step: int) -> torch.Tensor:
        rows = order[step * b.batch_size:(step + 1) * b.batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dev.type == "cpu"):
            logits = student(input_ids=tokens[rows, :-1].to(dev)).logits
        return distil_loss(logits, logp[rows].to(dev), idx[rows].to(dev))

    return fit(student, len(order) // b.batch_size, batch_loss, lr=b.lr, warmup=b.warmup_steps, ckpt_dir=ckpt_dir,
               ckpt_key=key, progress=progress, desc="distil draft (steps)")


@torch.no_grad()
def acceptance(target, draft, wins_NT: torch.Tensor, batch: int = 4) -> dict:
    """Draft against target on held-out windows, every position (teacher forcing): greedy agreement
    (argmax equal: the per-token acceptance of greedy speculative decoding), the mean of
    sum_v min(p_v, q_v) (standard speculative sampling's acceptance at temperature 1), and both
    models' cross-entropy on the text."""
    agree = overlap = ce_t = ce_d = 0.0
    n = 0
    for j in range(0, len(wins_NT), batch):
        w = wins_NT[j:j + batch]
        x, y = w[:, :-1], w[:, 1:]
        pos = torch.arange(x.shape[1]).expand(len(x), -1)
        lt, _ = target(x.to(target.device), pos.to(target.device))
        ld, _ = draft(x.to(draft.device), pos.to(draft.device))
        lt, ld = lt.float().cpu(), ld.float().cpu()
        pt, pd = torch.softmax(lt, -1), torch.softmax(ld, -1)
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        overlap += torch.minimum(pt, pd).sum(-1).sum().item()
        ce_t += F.cross_entropy(lt.reshape(-1, lt.shape[-1]), y.reshape(-1), reduction="sum").item()
        ce_d += F.cross_entropy(ld.reshape(-1, ld.shape[-1]), y.reshape(-1), reduction="sum").item()
        n += y.numel()
    return {"tokens": n, "greedy_agreement": agree / n, "mean_min_pq": overlap / n,
            "target_cross_entropy": ce_t / n, "draft_cross_entropy": ce_d / n}


# ----------------------------------------------------------------------------- build

DRAFTS_DIR = Path(__file__).parent / "drafts"


def default_out(target_dir: Path) -> Path:
    """The shipped draft of a target: models/drafts/<target directory name>-draft."""
    return DRAFTS_DIR / f"{Path(target_dir).name}-draft"


@dataclass
class BuildInputs:
    """What every build from a target's stdlib windows starts from (`build_inputs`)."""

    out_dir: Path
    work: Path
    tok: object
    info: load.ModelInfo
    train: torch.Tensor   # training stream
    held: torch.Tensor    # held-out stream
    wins: torch.Tensor    # [n, SEQ_LEN + 1] training windows in the seed's order
    key: dict             # the data's identity (shard and checkpoint keys)
    target: object        # the target, LlamaLM bf16
    t0: float


def pick_budget(budgets: dict, budget: str):
    """budgets[budget] (a ValueError naming the budgets for another name)."""
    if budget not in budgets:
        raise ValueError(f"budget must be one of {list(budgets)}, got {budget!r}")
    return budgets[budget]


@contextmanager
def build_inputs(target_dir: Path, seed: int, budget, out_dir: Path | None, work: Path | None, default_out_fn,
                 work_dir_fn, n_windows: int, key_extra: dict):
    """The common start of the draft's and the feature head's builds: threads set to the budget's
    (restored on exit), the target's tokenizer and info, the stdlib streams, the seed's windows, the
    data key and the target in bf16."""
    from verinfer.models.llama import LlamaLM

    threads_before = torch.get_num_threads()
    torch.set_num_threads(budget.threads)
    try:
        t0 = time.time()
        tok = load.load_tokenizer(target_dir)
        info = load.model_info(target_dir)
        train, held = streams(tok, budget.max_bytes)
        yield BuildInputs(
            Path(out_dir) if out_dir is not None else default_out_fn(target_dir),
            Path(work) if work is not None else work_dir_fn(target_dir, seed), tok, info, train, held,
            windows(train, n_windows, seed),
            {"target_sha256": info.weights_sha256, "stream_sha": _sha16(train), "seed": seed, **key_extra,
             "seq_len": SEQ_LEN},
            LlamaLM.from_pretrained(target_dir, dtype=torch.bfloat16), t0)
    finally:
        torch.set_num_threads(threads_before)


def build_draft(target_dir: Path, seed: int = 0, out_dir: Path | None = None, *, budget: str = "full",
                work: Path | None = None, progress: bool = True) -> dict:
    """Distil the draft of the target in `target_dir` (the recipe in this module's docstring) into
    out_dir; returns the build info (also out_dir/build_info.json, with MODEL_CARD.md)."""
    from verinfer.models.llama import LlamaLM

    b, target_dir = pick_budget(BUDGETS, budget), Path(target_dir)
    with build_inputs(target_dir, seed, b, out_dir, work, default_out, work_dir, b.teacher_windows,
                      {"top_k": TOP_K}) as bi:
        out_dir, work, tok, info_t, train, held, key, target, t0 = (bi.out_dir, bi.work, bi.tok, bi.info, bi.train,
                                                                     bi.held, bi.key, bi.target, bi.t0)
        shards, computed = teacher_shards(target, bi.wins, work / "teacher", key, progress=progress)
        t_teacher = time.time() - t0
        student = make_student(target_dir, seed)
        ckey = dict(key, name="draft", seed=seed, arch=DRAFT_ARCH, budget=asdict(b))
        losses = distil(student, shards, b, seed, ckpt_dir=work / budget / ".ckpt", key=ckey, progress=progress)
        out_dir.mkdir(parents=True, exist_ok=True)
        student.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
        tok.save_pretrained(str(out_dir))
        counts = token_counts(train, student.config.vocab_size)
        save_counts(out_dir, counts)
        for f in out_dir.iterdir():
            f.chmod(0o644)
        draft = LlamaLM.from_pretrained(out_dir, dtype=torch.bfloat16)
        acc = acceptance(target, draft, heldout_windows(held, b.eval_windows))
        n_params = sum(p.numel() for p in student.parameters())
        info = {"target": info_t.name, "target_weights_sha256": info_t.weights_sha256, "seed": seed, "budget": budget,
                "recipe": asdict(b), "arch": DRAFT_ARCH, "top_k": TOP_K, "seq_len": SEQ_LEN, "parameters": n_params,
                "training_tokens": int(b.teacher_windows * SEQ_LEN), "token_passes": int(b.steps * b.batch_size * SEQ_LEN),
                "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])), "first_loss": losses[0] if losses else None,
                "heldout": acc, "seconds": {"teacher": t_teacher, "total": time.time() - t0},
                "teacher_shards": {"total": len(shards), "computed_this_run": computed},
                "token_counts": counts_info(counts),
                "weights_sha256": load.model_info(out_dir).weights_sha256,
                "size_mb": (out_dir / "model.safetensors").stat().st_size / 1e6, "torch": torch.__version__}
        atomic_write_json(out_dir / "build_info.json", info)
        atomic_write_text(out_dir / "MODEL_CARD.md", model_card(info))
        return info


def _shards(info: dict) -> str:
    t = info.get("teacher_shards")
    if not t:
        return "teacher shards: not recorded"
    return f"{t['computed_this_run']} of {t['total']} teacher shards computed in that run" + (
        f"; {t['note']}" if t.get("note") else "")


def model_card(info: dict) -> str:
    a, h = info["arch"], info["heldout"]
    return "\n".join([
        f"# {info['target']}-draft", "",
        f"A draft model for speculative decoding with {info['target']} (same tokenizer), distilled by "
        f"`verinfer testbed build-draft --model {info['target']} --seed {info['seed']}` (recipe: "
        "src/verinfer/models/draft.py).", "",
        "| | |", "|---|---|",
        f"| architecture | Llama, d {a['hidden_size']}, {a['num_hidden_layers']} layers, heads "
        f"{a['num_attention_heads']}/{a['num_key_value_heads']} (GQA), MLP {a['intermediate_size']}, tied embeddings |",
        f"| parameters | {info['parameters']:,} ({info['size_mb']:.1f} MB bf16 safetensors) |",
        f"| teacher | top-{info['top_k']} log-probs of the target on {info['training_tokens']:,} tokens of stdlib "
        f"training files ({info['token_passes']:,} token passes) |",
        f"| distillation loss | first {info['first_loss']:.3f}, last 20 steps {info['final_loss']:.3f} |",
        f"| held-out stdlib ({h['tokens']:,} tokens) | greedy agreement with the target {h['greedy_agreement']:.3f}; "
        f"mean sum min(p, q) {h['mean_min_pq']:.3f} |",
        f"| cross-entropy on held-out text | draft {h['draft_cross_entropy']:.3f}, target {h['target_cross_entropy']:.3f} nats |",
        f"| build time | {info['seconds']['total'] / 60:.1f} min in the run that finished it "
        f"({info['seconds']['teacher'] / 60:.1f} teacher labelling, {_shards(info)}) |",
        *([f"| token counts | {c['file']}: occurrences of each id in the {c['stream_tokens']:,}-token training "
           f"stream ({c['distinct_ids']:,} distinct ids), for the frequency-ranked draft head "
           "(speculative/draft_vocab.py) |"] if (c := info.get("token_counts")) else []),
        ""])
