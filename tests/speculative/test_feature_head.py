"""The feature-level draft head (speculative/feature_head.py) and its drafting loop
(SpeculativeDecoder with a FeatureHead) on the shipped testbed target: the cached loop against a
from-scratch implementation (every forward recomputed over the whole sequence), greedy output ==
target-only decoding, batched == batch-1 when sampling, lossless by chi-square, and the LlamaLM /
Engine hooks it needs (features input, hidden states at every position)."""

import pytest
import torch

from verinfer.engine.engine import Engine, Request
from verinfer.errors import ModelError
from verinfer.models.llama import LlamaLM
from verinfer.models.load import load_tokenizer
from verinfer.models.testbed import TARGET_DIR, TOKENIZER_DIR
from verinfer.sampling.params import SamplingParams
from verinfer.speculative import feature_head as fh
from verinfer.speculative.decoder import SpeculativeDecoder, autoregressive
from verinfer.speculative.lossless import next_two_chi_square, two_token_chi_square
from verinfer.speculative.rules import Rule, accept_mask, leading_accepted


def _head(target: LlamaLM, seed: int = 0, scale: float = 1.0) -> fh.FeatureHead:
    w = fh.trainable(fh.head_weights(target, seed))
    g = torch.Generator().manual_seed(seed + 7)
    # a head whose attention and MLP matter (fresh heads start close to the identity on the feature)
    w = {k: (v + scale * 0.05 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v) for k, v in w.items()}
    return fh.FeatureHead(fh.head_config(target.config), {**w, **{k: target.w[k] for k in fh.SHARED}})


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    target = LlamaLM.from_pretrained(TARGET_DIR)
    return target, _head(target), load_tokenizer(TOKENIZER_DIR)


def _prompts(tok, texts=("def add(a, b):\n    return", "Q: 12+7=\nA: ", "import os\nimport ")):
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_hidden_all_and_features_hooks(models):
    """hidden_all returns the final-norm state at every position (= a forward without select); the
    head's embed is fc([e(token); feature]); Engine's prefill + one-token extends over the head give
    the logits of one whole-sequence forward."""
    target, head, tok = models
    ids = torch.tensor([_prompts(tok)[0]])
    T = ids.shape[1]
    pos = torch.arange(T)[None]
    _, h_full = target(ids, pos, hidden_layer=-1)
    _, h_sel = target(ids, pos, hidden_layer=-1, select=(torch.tensor([0]), torch.tensor([T - 1])), hidden_all=True)
    torch.testing.assert_close(h_sel, h_full, rtol=0, atol=0)
    feats = h_full
    e = torch.nn.functional.embedding(ids, head.w["embed_tokens.weight"])
    torch.testing.assert_close(head.embed(ids, feats), torch.cat([e, feats], -1) @ head.w[fh.FC].T)
    with pytest.raises(ValueError, match="features_BTD"):
        head(ids, pos)
    with pytest.raises(ValueError, match="tokens only"):
        target(ids, pos, features_BTD=feats)
    whole, _ = head(ids, pos, features_BTD=feats)
    eng = Engine(head, lean_prefill=True)
    k = T - 3
    b, lg, _ = eng.prefill_extend([Request("0", ids[0, :k].tolist(), SamplingParams(temperature=0.0, max_tokens=4))],
                                  None, features_BTD=feats[:, :k])
    got = [lg[:, -1]]
    for t in range(k, T):
        lt, _ = eng.extend(b, ids[:, t:t + 1], features_BTD=feats[:, t:t + 1])
        got.append(lt[:, 0])
    torch.testing.assert_close(torch.stack(got[:-1], 1), whole[:, k - 1:T - 1], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def _from_scratch(target, head, prompt, max_tokens, gamma, rule):
    """The head's greedy draft/verify loop with no cache at all: every round recomputes the target's
    features over the committed sequence and the head's chain over the whole sequence."""
    seq = list(prompt)
    out = []

    def fwd(model, toks, feats=None):
        x = torch.tensor([toks])
        kw = {} if feats is None else {"features_BTD": feats}
        return model(x, torch.arange(len(toks))[None], hidden_layer=-1, **kw)

    lg, _ = fwd(target, seq)
    seq.append(int(lg[0, -1].argmax()))
    out.append(seq[-1])
    while len(out) < max_tokens:
        n = len(seq)
        _, f = fwd(target, seq[:-1])                       # f_0 .. f_{n-2}
        toks, feats, xs = seq[1:], f, []
        for _ in range(gamma):
            hl, hh = fwd(head, toks, feats)
            x = int(hl[0, -1].argmax())
            xs.append(x)
            toks, feats = toks + [x], torch.cat([feats, hh[:, -1:]], 1)
        tl, _ = fwd(target, seq + xs)
        p = torch.softmax(tl[:, n - 1:], -1)               # p_1 .. p_{G+1}
        hl, _ = fwd(head, toks[:-1], feats[:, :-1])        # q of each drafted position
        q = torch.softmax(hl[:, n - 2:], -1)
        a = int(leading_accepted(accept_mask(rule, p[:, :gamma], q, torch.tensor([xs]), None, True, None))[0])
        new = xs[:a] + [int(p[0, a].argmax())]
        for t in new:
            if len(out) < max_tokens:
                out.append(t)
                seq.append(t)
    return out


@pytest.mark.parametrize("rule", [Rule("standard"), Rule("kl", 1e9)])
def test_cached_loop_equals_from_scratch(models, rule):
    """The decoder's cached loop (catch-up on the verification's features, rollback by length) emits
    what a from-scratch implementation emits, token for token (fp32, greedy). The KL judge with an
    unbounded threshold accepts most drafts, so the catch-up over accepted tokens runs every round."""
    target, head, tok = models
    prompts = _prompts(tok)
    outs = SpeculativeDecoder(target, head, rule, gamma=3).generate(prompts, 24, batch_size=3)
    for p, o in zip(prompts, outs):
        assert o.output_token_ids == _from_scratch(target, head, p, 24, 3, rule)
    if rule.name == "kl":
        assert sum(o.accepted for o in outs) > 20     # the catch-up was exercised
    for o in outs:  # per-position counters add up
        assert sum(o.accepted_at) == o.accepted and o.proposed_at[0] == o.target_forwards - 1


def test_greedy_standard_equals_target_only_and_batch_1(models):
    target, head, tok = models
    prompts = _prompts(tok)
    ref = autoregressive(target, prompts, 20, batch_size=3)
    for bs in (1, 3):
        outs = SpeculativeDecoder(target, head, gamma=4).generate(prompts, 20, batch_size=bs)
        assert [o.output_token_ids for o in outs] == [r.output_token_ids for r in ref]
        assert all(o.events[0] == "t" for o in outs)
    # the head's FR-Spec rows: still the target's output
    vocab = torch.arange(0, target.config.vocab_size, 2)
    outs = SpeculativeDecoder(target, head, gamma=4, draft_vocab=vocab).generate(prompts, 20, batch_size=3)
    assert [o.output_token_ids for o in outs] == [r.output_token_ids for r in ref]


@pytest.mark.parametrize("conf", [0.0, 0.3])
def test_sampling_batched_equals_batch_1(models, conf):
    target, head, tok = models
    prompts = _prompts(tok)
    dec = SpeculativeDecoder(target, head, gamma=3, temperature=0.8, draft_confidence=conf)
    a = dec.generate(prompts, 16, seeds=[3, 4, 5], batch_size=1)
    b = dec.generate(prompts, 16, seeds=[3, 4, 5], batch_size=3)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    assert [o.events for o in a] == [o.events for o in b]


def test_draft_confidence_with_head_keeps_greedy_output(models):
    """The head's blocks cut by its own confidence (and its FR-Spec rows): the target's greedy
    output, fewer drafted tokens."""
    target, head, tok = models
    prompts = _prompts(tok)
    ref = autoregressive(target, prompts, 20, batch_size=3)
    vocab = torch.arange(0, target.config.vocab_size, 2)
    for dv in (None, vocab):
        full = SpeculativeDecoder(target, head, gamma=4, draft_vocab=dv).generate(prompts, 20, batch_size=3)
        cut = SpeculativeDecoder(target, head, gamma=4, draft_vocab=dv, draft_confidence=0.5).generate(
            prompts, 20, batch_size=3)
        assert [o.output_token_ids for o in cut] == [r.output_token_ids for r in ref]
        assert sum(o.drafted for o in cut) < sum(o.drafted for o in full)


def test_head_refuses_what_it_cannot_do(models):
    target, head, _ = models
    with pytest.raises(ValueError, match="no separate draft hidden state"):
        SpeculativeDecoder(target, head, Rule("autojudge", 0.5, object()))
    with pytest.raises(ModelError, match="build-head"):
        fh.FeatureHead.from_target("/nonexistent-head", target)


@pytest.mark.parametrize("config", [None, "{not json", "[1, 2]", '{"hidden_size": 7, "vocab_size": 7}'])
def test_a_broken_head_directory_is_a_clear_error(models, tmp_path, config):
    """A head file without its config, a malformed config, or one built for another target: a
    ModelError naming the file and what to do, never a raw JSON or shape error."""
    from verinfer.io import atomic_save_safetensors

    target, head, _ = models
    atomic_save_safetensors({k: v.contiguous() for k, v in fh.trainable(head.w).items()}, tmp_path / fh.HEAD_FILE)
    if config is not None:
        (tmp_path / fh.HEAD_CONFIG).write_text(config)
    with pytest.raises(ModelError) as e:
        fh.FeatureHead.from_target(tmp_path, target)
    assert str(tmp_path) in str(e.value) and ("build-head" in str(e.value) or "built for" in str(e.value))


@pytest.mark.slow
def test_standard_with_head_is_lossless(models):
    """Chi-square of the first two sampled tokens (the second drafted by the head) against the
    target's exact distribution; the KL judge with no KL bound (it accepts wherever the target's top-1
    probability is <= 0.9) is rejected by the same test: the test has power."""
    target, head, tok = models
    prompt = tok.encode("    def __init__(self", add_special_tokens=False)
    n = 2000
    p = {}
    for name, rule, conf in [("standard", Rule("standard"), 0.0), ("kl", Rule("kl", 1e9), 0.0),
                             ("standard_cut", Rule("standard"), 0.3)]:
        outs = SpeculativeDecoder(target, head, rule, gamma=3, temperature=1.0, draft_confidence=conf).generate(
            [prompt] * n, max_tokens=3, seeds=list(range(n)), batch_size=n)
        _, p[name], _ = two_token_chi_square(target, [tuple(o.output_token_ids[:2]) for o in outs], prompt)
        # tokens 2-3 after the commonest first token: where a cut block's bonus token acts
        _, p[name + "_next"], _, m = next_two_chi_square(target, [o.output_token_ids for o in outs], prompt)
        assert m >= 200
        if conf:
            assert any(o.events[:3] == "tab" for o in outs)  # blocks cut after one accepted token, then a bonus
    print(p)
    assert min(p["standard"], p["standard_next"], p["standard_cut"], p["standard_cut_next"]) > 1e-3
    assert p["kl"] < 1e-3
