"""Train the feature-level draft head (speculative/feature_head.py) of a real target from the
target's own hidden states, for speculative decoding.

Recipe of `verinfer models build-head --model smollm2-135m-instruct --seed 0` (deterministic for a
seed on one machine; every stage resumes from what it already wrote):

  1. data: SEQ_LEN+1-token windows of the stdlib TRAINING files (models/draft.py's streams and
     window order: the held-out files, the source of the next-line and multi-line tasks, are never
     trained on).
  2. features: the target's final-norm hidden state f_t at every position of every window (its bf16
     forward, the dtype the benchmark decodes in), SHARD windows per safetensors shard.
  3. head: FeatureHead (one decoder layer, fc over [e(s_{t+1}); f_t]; the target's embedding and
     lm_head shared and frozen), fp32, seeded (feature_head.head_weights).
  4. loss (EAGLE section 3.3): SmoothL1(f^_{t+1}, f_{t+1}) + W_CLS * sum_v p_v * -log q_v, p and q the
     target's and the head's next-token distributions over the FR-Spec rows of the draft vocabulary
     (speculative/draft_vocab.py) at temperature 1; the input features get uniform noise of
     NOISE x their RMS (EAGLE's data noise: the head later reads its own predictions). AdamW, warmup +
     cosine (testbed.fit), checkpoints every few minutes: an interrupted build resumes.
  5. writes out_dir: HEAD_FILE (bf16 safetensors, the head's own weights only), HEAD_CONFIG, the
     draft vocabulary's token counts (draft.COUNTS_FILE), build_info.json and MODEL_CARD.md with the
     acceptance against the target measured by greedy speculative decoding on held-out stdlib
     prompts: per draft position k = 1..GAMMA the share of rounds whose k-th drafted token was
     accepted, and the MAT at gamma GAMMA.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from verinfer.io import atomic_save_safetensors, atomic_write_json, atomic_write_text
from verinfer.models import corpus
from verinfer.models.draft import build_inputs, heldout_windows, pick_budget, token_counts, window_shards
from verinfer.models.testbed import SEQ_LEN, fit
from verinfer.speculative import feature_head as fh

SHARD = 64          # windows per feature shard
W_CLS = 1.0         # classification-loss weight (EAGLE-1: 0.1 on 7B targets; on SmolLM2 the 0.1 head of the first
                    # build agreed with the target's top-1 on 52% of held-out positions, teacher-forced; EAGLE-3 trains on
                    # the token loss alone)
NOISE = 0.05        # uniform input-feature noise, as a share of the features' RMS
VOCAB_N = 16384     # FR-Spec rows of the classification loss (the draft's rule picks 16,384 on SmolLM2)
GAMMA = 4           # chain length of the model card's acceptance


@dataclass(frozen=True)
class HeadBudget:
    """How much to train. Counts are fixed (not timed), so every machine trains the same steps."""

    windows: int          # SEQ_LEN-token windows of target features
    epochs: int
    batch_size: int
    lr: float
    warmup_steps: int
    eval_windows: int
    threads: int = 2
    max_bytes: int = corpus.DEFAULT_MAX_BYTES

    @property
    def steps(self) -> int:
        return self.epochs * self.windows // self.batch_size


BUDGETS = {
    # 3,072 windows = 786k feature tokens (the first 1,536 shards are the first build's), 2 epochs
    "full": HeadBudget(windows=3072, epochs=2, batch_size=8, lr=1e-3, warmup_steps=30, eval_windows=16),
    "tiny": HeadBudget(windows=4, epochs=1, batch_size=2, lr=1e-3, warmup_steps=1, eval_windows=1, threads=1,
                       max_bytes=1_000_000),
}


def default_out(target_dir: Path) -> Path:
    """The shipped head of a target: models/drafts/<target directory name>-head."""
    from verinfer.models.draft import DRAFTS_DIR

    return DRAFTS_DIR / f"{Path(target_dir).name}-head"


def work_dir(target_dir: Path, seed: int) -> Path:
    from verinfer.models.catalog import cache_dir

    return cache_dir() / "work" / f"{Path(target_dir).name}-head-seed{seed}"


# ----------------------------------------------------------------------------- features

@torch.no_grad()
def target_features(target, tokens_BT: torch.Tensor) -> torch.Tensor:
    """f_BTD: the target's final-norm hidden state at every position (its plain causal forward)."""
    B, T = tokens_BT.shape
    pos = torch.arange(T, device=target.device).expand(B, -1)
    # select one position: the lm_head runs once per row, the hidden states come back whole
    sel = (torch.arange(B, device=target.device), torch.full((B,), T - 1, device=target.device))
    _, f_BTD = target(tokens_BT.to(target.device), pos, hidden_layer=-1, select=sel, hidden_all=True)
    return f_BTD


def feature_shards(target, wins_NT: torch.Tensor, work: Path, key: dict, *, batch: int = 8,
                   progress: bool = True) -> tuple[list[Path], int]:
    """The target's bf16 features of every window, SHARD windows per safetensors file in `work`
    (draft.window_shards: kept when the key matches and a shard holds exactly its windows)."""
    def label(w_NT: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"features": torch.cat([target_features(target, w_NT[j:j + batch]).to(torch.bfloat16).cpu()
                                       for j in range(0, len(w_NT), batch)])}

    return window_shards(wins_NT, work, key, "features", label, "target features (windows)", shard=SHARD,
                         progress=progress)


# ----------------------------------------------------------------------------- training

class _Params(torch.nn.Module):
    """The head's trainable tensors as parameters (for testbed.fit), by name."""

    def __init__(self, w: dict[str, torch.Tensor]):
        super().__init__()
        self.names = sorted(w)
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(w[n].float().clone()) for n in self.names])

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.ps))


def head_loss(head: fh.FeatureHead, tokens_BT: torch.Tensor, f_BTD: torch.Tensor, E_ND: torch.Tensor,
              noise: float = NOISE, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """EAGLE's loss on one batch of windows (module docstring, step 4): tokens_BT [B, T+1] and the
    target's features f_BTD [B, T] of tokens_BT[:, :T]. Head position t reads (s_{t+1}, f_t + noise)
    and is scored against f_{t+1} and the target's distribution there."""
    x_BT = tokens_BT[:, 1:-1]                # s_1 .. s_{T-1}
    f_in = f_BTD[:, :-1].float()             # f_0 .. f_{T-2}
    f_out = f_BTD[:, 1:].float()             # f_1 .. f_{T-1}
    if noise > 0:
        rms = f_in.pow(2).mean().sqrt()
        u = torch.rand(f_in.shape, generator=generator) * 2 - 1
        f_in = f_in + noise * rms * u
    B, T = x_BT.shape
    pos = torch.arange(T).expand(B, -1)
    sel = (torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))  # lm_head on one position only
    _, fh_BTD = head(x_BT, pos, hidden_layer=-1, select=sel, hidden_all=True, features_BTD=f_in)
    reg = F.smooth_l1_loss(fh_BTD, f_out)
    with torch.no_grad():
        p = torch.softmax(f_out @ E_ND.T, -1)
    cls = -(p * torch.log_softmax(fh_BTD @ E_ND.T, -1)).sum(-1).mean()
    return reg + W_CLS * cls, {"reg": reg.item(), "cls": cls.item()}


def train_head(target, shards: list[Path], b: HeadBudget, seed: int, ids_N: torch.Tensor, *, ckpt_dir: Path,
               key: dict, progress: bool = True) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train a fresh head on the feature shards; returns (its trained weights, fp32; the losses)."""
    data = [load_file(str(p)) for p in shards]
    tokens = torch.cat([d["tokens"] for d in data])
    feats = torch.cat([d["features"] for d in data])
    N = len(tokens)
    g = torch.Generator().manual_seed(seed + 1)
    order = torch.cat([torch.randperm(N, generator=g) for _ in range(b.epochs)])
    params = _Params(fh.trainable(fh.head_weights(target, seed)))
    shared = {k: target.w[k].float() for k in fh.SHARED}
    head = fh.FeatureHead(fh.head_config(target.config), {**params.weights(), **shared})
    E_ND = shared["lm_head.weight"][ids_N]
    noise_g = torch.Generator().manual_seed(seed + 2)

    def batch_loss(step: int) -> torch.Tensor:
        rows = order[step * b.batch_size:(step + 1) * b.batch_size]
        loss, _ = head_loss(head, tokens[rows], feats[rows], E_ND, generator=noise_g)
        return loss

    losses = fit(params, len(order) // b.batch_size, batch_loss, lr=b.lr, warmup=b.warmup_steps, ckpt_dir=ckpt_dir,
                 ckpt_key=key, progress=progress, desc="train head (steps)")
    return {k: v.detach() for k, v in params.weights().items()}, losses


# ----------------------------------------------------------------------------- acceptance

def chain_acceptance(target, head: fh.FeatureHead, prompts: list[list[int]], max_tokens: int = 64,
                     gamma: int = GAMMA) -> dict:
    """Greedy speculative decoding with the head (speculative/decoder.py, the standard rule) on
    held-out prompts: accept_at[k-1] = share of rounds whose k-th drafted token was accepted (of the
    rounds that drafted k tokens), mat = emitted tokens / target forwards (counts the target's token)."""
    from verinfer.speculative.decoder import SpeculativeDecoder

    outs = SpeculativeDecoder(target, head, gamma=gamma).generate(prompts, max_tokens, batch_size=1)
    acc_k = [sum(o.accepted_at[k] for o in outs) / max(1, sum(o.proposed_at[k] for o in outs)) for k in range(gamma)]
    return {"prompts": len(prompts), "max_tokens": max_tokens, "gamma": gamma, "accept_at": acc_k,
            "mat": sum(len(o.output_token_ids) for o in outs) / sum(o.target_forwards for o in outs),
            "rounds": sum(o.proposed_at[0] for o in outs)}


def heldout_prompts(held: torch.Tensor, n: int, context: int = 256) -> list[list[int]]:
    """n prompts of `context` tokens evenly spread over the held-out stream."""
    w = heldout_windows(held, n)
    return [r[:context].tolist() for r in w]


# ----------------------------------------------------------------------------- build

def build_head(target_dir: Path, seed: int = 0, out_dir: Path | None = None, *, budget: str = "full",
               work: Path | None = None, progress: bool = True) -> dict:
    """Train the head of the target in `target_dir` (the recipe in this module's docstring) into
    out_dir; returns the build info (also out_dir/build_info.json, with MODEL_CARD.md)."""
    from verinfer.models.llama import LlamaLM
    from verinfer.speculative.draft_vocab import top_ids

    b, target_dir = pick_budget(BUDGETS, budget), Path(target_dir)
    with build_inputs(target_dir, seed, b, out_dir, work, default_out, work_dir, b.windows, {"dtype": "bf16"}) as bi:
        out_dir, work, info_t, train, held, key, target, t0 = (bi.out_dir, bi.work, bi.info, bi.train, bi.held, bi.key,
                                                               bi.target, bi.t0)
        shards, computed = feature_shards(target, bi.wins, work / "features", key, progress=progress)
        t_feat = time.time() - t0
        counts = token_counts(train, target.config.vocab_size)
        n_vocab = min(VOCAB_N, target.config.vocab_size)
        ids_N = top_ids(counts, n_vocab)
        target32 = LlamaLM.from_pretrained(target_dir, dtype=torch.float32)
        ckey = dict(key, name="head", budget=asdict(b), w_cls=W_CLS, noise=NOISE, vocab_n=n_vocab)
        w, losses = train_head(target32, shards, b, seed, ids_N, ckpt_dir=work / budget / ".ckpt", key=ckey,
                               progress=progress)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_save_safetensors({k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}, out_dir / fh.HEAD_FILE)
        c = target.config
        atomic_write_json(out_dir / fh.HEAD_CONFIG, {"target": info_t.name, "hidden_size": c.hidden_size,
                                                     "vocab_size": c.vocab_size, "layers": 1,
                                                     "target_weights_sha256": info_t.weights_sha256})
        from verinfer.models.draft import save_counts

        save_counts(out_dir, counts)
        head = fh.FeatureHead.from_target(out_dir, target)
        acc = chain_acceptance(target, head, heldout_prompts(held, b.eval_windows))
        n_params = sum(v.numel() for v in w.values())
        info = {"target": info_t.name, "target_weights_sha256": info_t.weights_sha256, "seed": seed, "budget": budget,
                "recipe": asdict(b), "w_cls": W_CLS, "noise": NOISE, "loss_vocab": n_vocab, "seq_len": SEQ_LEN,
                "parameters": n_params, "training_tokens": int(b.windows * SEQ_LEN),
                "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])), "first_loss": losses[0] if losses else None,
                "heldout": acc, "seconds": {"features": t_feat, "total": time.time() - t0},
                "feature_shards": {"total": len(shards), "computed_this_run": computed},
                "size_mb": (out_dir / fh.HEAD_FILE).stat().st_size / 1e6, "torch": torch.__version__}
        atomic_write_json(out_dir / "build_info.json", info)
        atomic_write_text(out_dir / "MODEL_CARD.md", model_card(info))
        for f in out_dir.iterdir():
            f.chmod(0o644)
        return info


def model_card(info: dict) -> str:
    h = info["heldout"]
    acc = ", ".join(f"{k + 1}: {a:.3f}" for k, a in enumerate(h["accept_at"]))
    return "\n".join([
        f"# {info['target']}-head", "",
        f"A feature-level draft head (EAGLE-style, speculative/feature_head.py) for {info['target']}, trained by "
        f"`verinfer models build-head --model {info['target']} --seed {info['seed']}` (recipe: "
        "src/verinfer/speculative/head_build.py). It reads the target's final hidden state and the next token, and "
        "drafts through the target's own embedding and lm_head (not stored here).", "",
        "| | |", "|---|---|",
        "| architecture | one Llama decoder layer of the target's shape + fc (2D -> D) + norm |",
        f"| parameters | {info['parameters']:,} ({info['size_mb']:.1f} MB bf16 safetensors) |",
        f"| data | the target's bf16 features on {info['training_tokens']:,} tokens of stdlib training files, "
        f"{info['recipe']['epochs']} epochs |",
        f"| loss | SmoothL1 on features + {info['w_cls']} x CE over the {info['loss_vocab']:,} most frequent tokens; "
        f"first {info['first_loss']:.3f}, last 20 steps {info['final_loss']:.3f} |",
        f"| held-out stdlib, greedy speculative decoding ({h['prompts']} prompts x {h['max_tokens']} tokens, "
        f"{h['rounds']:,} rounds) | accepted at draft position {acc}; "
        f"MAT at gamma {h['gamma']} {h['mat']:.2f} (counts the target's own token) |",
        f"| build time | {info['seconds']['total'] / 60:.1f} min in the run that finished it "
        f"({info['seconds']['features'] / 60:.1f} features) |",
        ""])
