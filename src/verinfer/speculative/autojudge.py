"""AutoJudge-style trained judge (Garipov et al. 2025): mine which target/draft mismatches
matter for the final answer, then fit a logistic regression on hidden states.

Mining, per training problem (greedy decoding, our own implementation of the procedure the
AutoJudge paper describes):
  1. r = the target's greedy response; A = its final answer (the digits before the newline).
  2. Teacher-force the draft over prompt + r and take its argmax at every output position.
  3. Walk the mismatches left to right. At mismatch i, replace r[i] by the draft's token and let
     the target continue greedily. If the final answer is still A the mismatch is UNIMPORTANT
     (label 0) and r becomes the alternative response (later mismatches are judged on it);
     otherwise it is IMPORTANT (label 1) and r is kept. Continue after position i.
  Features of mismatch i: [h_target; h_draft], the final-norm hidden states (what each lm_head
  sees) at the position that predicts output token i.

The judge is StandardScaler + LogisticRegression (scikit-learn); at decoding time a drafted
token is accepted beyond the standard rule when P(important) < threshold (rules.relax_autojudge).
Stored as JSON (no pickle): mean, scale, coef, intercept.

Shape key: N = mined mismatches, D = feature dim (target hidden + draft hidden), B/G as in rules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from verinfer.engine.engine import Engine
from verinfer.models.llama import LlamaLM
from verinfer.sampling.params import stop_reason
from verinfer.speculative.decoder import autoregressive


def final_answer(text: str) -> str:
    """The answer an arithmetic continuation gives: the text before the first newline, stripped."""
    return text.split("\n", 1)[0].strip()


@dataclass
class MinedSet:
    feats_ND: torch.Tensor
    labels_N: torch.Tensor   # 1 = important (changes the final answer)
    problems: int
    mismatches_per_problem: float


def _hidden_at(engine: Engine, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and final-norm hidden states (what lm_head sees) at every position of seq."""
    logits_TV, hidden_TD = engine.forward_sequence(seq, hidden_layer=-1)
    return logits_TV.cpu(), hidden_TD.float().cpu()


@torch.no_grad()
def mine(target: LlamaLM, draft: LlamaLM, tokenizer, prompts: list[list[int]], max_tokens: int,
         stop_token_ids: tuple[int, ...], progress=None) -> MinedSet:
    feats, labels, n_mis = [], [], 0
    target_engine, draft_engine = Engine(target), Engine(draft)
    dec = lambda ids: tokenizer.decode(ids)  # noqa: E731
    refs = autoregressive(target, prompts, max_tokens, stop_token_ids=stop_token_ids, batch_size=16)
    for k, (prompt, ref) in enumerate(zip(prompts, refs)):
        resp = ref.output_token_ids
        answer = final_answer(dec(resp))
        P = len(prompt)
        left = 0
        while True:
            seq = prompt + resp
            dlogits, hd = _hidden_at(draft_engine, seq)
            d_argmax = dlogits[P - 1 : P - 1 + len(resp)].argmax(-1).tolist()
            mism = [i for i in range(left, len(resp)) if resp[i] != d_argmax[i]]
            if not mism:
                break
            i = mism[0]
            _, ht = _hidden_at(target_engine, seq)
            feats.append(torch.cat([ht[P - 1 + i], hd[P - 1 + i]]))
            alt_prefix = resp[:i] + [d_argmax[i]]
            done = stop_reason(d_argmax[i], len(alt_prefix), max_tokens, stop_token_ids) is not None
            alt = alt_prefix if done else alt_prefix + autoregressive(
                target, [prompt + alt_prefix], max_tokens - len(alt_prefix), stop_token_ids=stop_token_ids)[0].output_token_ids
            same = final_answer(dec(alt)) == answer
            labels.append(0 if same else 1)
            n_mis += 1
            if same:
                resp = alt
            left = i + 1
        if progress is not None:
            progress(k + 1)
    if not feats:
        raise ValueError("no target/draft mismatches were found: nothing to train the judge on")
    return MinedSet(torch.stack(feats), torch.tensor(labels), len(prompts), n_mis / max(1, len(prompts)))


class Judge:
    """Logistic regression on standardized [h_target; h_draft]; prob_important works on any
    leading shape (..., D) and on any device."""

    def __init__(self, mean_D, scale_D, coef_D, intercept: float):
        self.mean_D, self.scale_D, self.coef_D = (torch.as_tensor(t, dtype=torch.float32) for t in (mean_D, scale_D, coef_D))
        self.intercept = float(intercept)

    def prob_important(self, feats_BGD: torch.Tensor) -> torch.Tensor:
        dev = feats_BGD.device
        z = ((feats_BGD.float() - self.mean_D.to(dev)) / self.scale_D.to(dev)) @ self.coef_D.to(dev) + self.intercept
        return torch.sigmoid(z)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"mean": self.mean_D.tolist(), "scale": self.scale_D.tolist(),
                                          "coef": self.coef_D.tolist(), "intercept": self.intercept}))

    @classmethod
    def from_json(cls, path: str | Path) -> "Judge":
        try:
            d = json.loads(Path(path).read_text())
            return cls(d["mean"], d["scale"], d["coef"], d["intercept"])
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{path}: not a judge file ({e}); train one with `verinfer speculative train-autojudge`") from e


def train_judge(mined: MinedSet, C: float = 1.0, seed: int = 0) -> Judge:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    X, y = mined.feats_ND.numpy(), mined.labels_N.numpy()
    D = X.shape[1]
    if len(set(y.tolist())) < 2:
        # One class only (e.g. answer-only arithmetic: every mismatch is a digit of the answer,
        # so every one changes it). The fitted model is the constant classifier of that class.
        p = float(y[0])
        return Judge(torch.zeros(D), torch.ones(D), torch.zeros(D), 30.0 if p == 1 else -30.0)
    sc = StandardScaler().fit(X)
    lr = LogisticRegression(C=C, max_iter=5000, class_weight="balanced", random_state=seed).fit(sc.transform(X), y)
    return Judge(sc.mean_, sc.scale_, lr.coef_[0], lr.intercept_[0])
