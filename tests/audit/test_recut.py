"""The replay re-cuts claims derived from text where the reference segments the same text
differently (audit.replay.recut_claims): an honest greedy reply whose text re-encodes to other ids
is scored on the model's own ids; without the re-cut it diverges from the split on."""

import pyarrow.compute as pc
import pytest

from verinfer.apps.pipeline import verifier_engine
from verinfer.audit.replay import score_chunk
from verinfer.claims import Claim
from verinfer.engine.engine import Request
from verinfer.models.testbed import TARGET_DIR
from verinfer.retokenize import Retokenizer
from verinfer.sampling.params import SamplingParams
from tests.test_retokenize import TEMPLATE, split_segmentation

GREEDY = SamplingParams(0.0, -1, 1.0, 0.0, None, 24, "vllm-cpu")
QUESTIONS = ["import os\nimport sys", "class Stack:\n    def __init__(self):",
             "def read_file(path):\n    with open(path) as f:", "return self._items"]


@pytest.fixture(scope="module")
def setup():
    retok = Retokenizer.for_model(TARGET_DIR, chat_template=TEMPLATE)
    engine = verifier_engine(TARGET_DIR)
    msgs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    done = engine.generate([Request(str(i), retok.prompt_ids(m), GREEDY) for i, m in enumerate(msgs)], batch_size=4)
    return retok, engine, msgs, done


@pytest.mark.slow  # generates and replays on the testbed (~10 s on 2 busy cores)
def test_recut_restores_the_models_ids(setup):
    retok, engine, msgs, done = setup
    claims, truth = [], []
    for i, (m, d) in enumerate(zip(msgs, done)):
        ids = list(d.output_token_ids)
        text_ids = ids[:-1] if d.finish_reason == "stop" else ids
        c = Claim.from_chat(f"c{i}", "m", m, retok.tokenizer.decode(text_ids), d.finish_reason, GREEDY, retok)
        other, _ = split_segmentation(retok, c.output_token_ids)  # a provider-side cut the model did not take
        claims.append(Claim(c.id, c.model, c.prompt_token_ids, other, c.sampling, extra=c.extra))
        truth.append(ids)
    naive = score_chunk(claims, engine)
    recut = score_chunk(claims, engine, retokenizer=retok)
    true_ids = score_chunk([Claim(c.id, c.model, c.prompt_token_ids, ids, c.sampling)
                            for c, ids in zip(claims, truth)], engine)
    for i, c in enumerate(claims):
        rows = recut.filter(pc.equal(recut["claim_id"], c.id))
        assert rows["token_id"].to_pylist() == truth[i]
    for col in ("token_id", "exact_match", "margin", "cross_entropy"):  # scored exactly as the true ids
        assert recut[col].to_pylist() == true_ids[col].to_pylist()
    assert pc.sum(naive["exact_match"]).as_py() < pc.sum(true_ids["exact_match"]).as_py()  # naive: diverges at the split
    # claims whose ids were returned by the endpoint are never re-cut
    returned = [Claim(c.id, c.model, c.prompt_token_ids, c.output_token_ids, c.sampling,
                      extra={"chat": {**c.chat, "tokens": "returned"}}) for c in claims]
    same = score_chunk(returned, engine, retokenizer=retok)
    assert same["token_id"].to_pylist() == naive["token_id"].to_pylist()
