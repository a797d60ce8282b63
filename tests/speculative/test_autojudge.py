"""AutoJudge-style judge: torch scoring == scikit-learn's predict_proba, JSON round trip, mining
labels checked against a direct re-generation."""

import numpy as np
import pytest
import torch

from verinfer.models.llama import LlamaLM
from verinfer.models.load import load_tokenizer
from verinfer.models.testbed import DRAFT_DIR, TARGET_DIR, TOKENIZER_DIR
from benchmarks.spec_tasks import newline_tokens
from verinfer.speculative.autojudge import Judge, MinedSet, final_answer, mine, train_judge
from verinfer.speculative.decoder import autoregressive
from verinfer.speculative.rules import Rule, accept_mask


def _synthetic(n=400, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g) * torch.arange(1, d + 1) + 3.0
    y = (X[:, 0] - 0.5 * X[:, 2] + 0.3 * torch.randn(n, generator=g) > 1.5).long()
    return MinedSet(X, y, n, 1.0)


def test_judge_matches_sklearn_and_round_trips(tmp_path):
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    m = _synthetic()
    j = train_judge(m)
    X, y = m.feats_ND.numpy(), m.labels_N.numpy()
    sc = StandardScaler().fit(X)
    ref = LogisticRegression(C=1.0, max_iter=5000, class_weight="balanced", random_state=0).fit(sc.transform(X), y)
    got = j.prob_important(m.feats_ND).numpy()
    assert np.allclose(got, ref.predict_proba(sc.transform(X))[:, 1], atol=1e-5)
    j.to_json(tmp_path / "j.json")
    j2 = Judge.from_json(tmp_path / "j.json")
    assert torch.allclose(j2.prob_important(m.feats_ND[None]), j.prob_important(m.feats_ND[None]))
    with pytest.raises(ValueError, match="not a judge file"):
        Judge.from_json(tmp_path / "missing.json")


def test_single_class_labels_give_a_constant_judge():
    m = _synthetic()
    m.labels_N = torch.ones_like(m.labels_N)
    j = train_judge(m)
    assert (j.prob_important(m.feats_ND) > 0.999).all()
    # so the autojudge rule relaxes nothing: identical to the standard rule
    p = torch.softmax(torch.randn(2, 3, 7), -1)
    x = torch.randint(0, 7, (2, 3))
    feats = torch.randn(2, 3, m.feats_ND.shape[1])
    assert torch.equal(accept_mask(Rule("autojudge", 0.9, j), p, p, x, None, True, feats),
                       accept_mask(Rule("standard"), p, p, x, None, True))


def test_mined_labels_match_direct_regeneration():
    torch.set_num_threads(1)
    t, d, tok = LlamaLM.from_pretrained(TARGET_DIR), LlamaLM.from_pretrained(DRAFT_DIR), load_tokenizer(TOKENIZER_DIR)
    stop = newline_tokens(tok)
    prompts = [tok.encode(q, add_special_tokens=False) for q in ("Q: 37+45=\nA: ", "Q: 9-7=\nA: ", "Q: 12*11=\nA: ")]
    m = mine(t, d, tok, prompts, 8, stop)
    assert m.feats_ND.shape[1] == t.config.hidden_size + d.config.hidden_size
    assert m.labels_N.numel() == m.feats_ND.shape[0] >= 1
    # the first mismatch of the first prompt, redone by hand
    p = prompts[0]
    ref = autoregressive(t, [p], 8, stop_token_ids=stop)[0].output_token_ids
    with torch.no_grad():
        lg, _ = d(torch.tensor([p + ref]), torch.arange(len(p) + len(ref))[None])
    dm = lg[0, len(p) - 1 : len(p) - 1 + len(ref)].argmax(-1).tolist()
    i = next(k for k in range(len(ref)) if ref[k] != dm[k])
    alt = ref[:i] + [dm[i]]
    if dm[i] not in stop:
        alt += autoregressive(t, [p + alt], 8 - len(alt), stop_token_ids=stop)[0].output_token_ids
    expect = int(final_answer(tok.decode(alt)) != final_answer(tok.decode(ref)))
    assert int(m.labels_N[0]) == expect
