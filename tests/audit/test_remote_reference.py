"""The remote reference (issue 18 item 2): a stub vLLM server on loopback answers prompt_logprobs
computed from the shipped testbed target, as vLLM does (fp32 log-softmax of the raw logits, the top
k plus the actual token, keyed by token id); scores through it must equal local replay's column by
column where the claim's filters stay within k, and be marked approximate elsewhere. Error cases:
a dead server, a model it does not serve, --max-logprobs below k, a reply without prompt_logprobs,
a malformed reply. Transient 503s are retried; an interrupted run resumes without refetching.
Impossible rows (issue 34: unnormalized, degenerate, non-finite, positive logprobs) are refused in
both protocols before anything is scored."""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("openai")

from verinfer.apps.pipeline import score, verifier_engine  # noqa: E402
from verinfer.audit.remote_reference import ReferenceServerError, exactness  # noqa: E402
from verinfer.audit.replay import replay_batch_size  # noqa: E402
from verinfer.scores import gap_column_names  # noqa: E402
from verinfer.claims import read_claims, write_claims  # noqa: E402
from verinfer.models.prompts import prompts_for  # noqa: E402
from verinfer.models.testbed import TARGET_DIR  # noqa: E402
from verinfer.providers.simulated import HONEST, run_provider  # noqa: E402
from verinfer.sampling.params import SamplingParams  # noqa: E402

K = 20  # logprobs asked (vLLM's default --max-logprobs)
SETTINGS = {  # name: (temperature, top_k, top_p, min_p); exact with K = 20: greedy and top_k < 20
    "topk8": (1.0, 8, 0.95, 0.0), "topk12-minp": (0.8, 12, 1.0, 0.05), "greedy": (0.0, 0, 1.0, 0.0),
    "topk50": (1.0, 50, 0.95, 0.0), "topp-only": (1.0, 0, 0.9, 0.0),
}


class StubVllm:
    """An OpenAI-compatible server on 127.0.0.1 answering /v1/completions with vLLM's prompt_logprobs
    reply; `mode` switches on a misbehaviour."""

    def __init__(self, model="testbed", max_logprobs=K):
        self.engine = verifier_engine(TARGET_DIR)
        self.model, self.max_logprobs, self.mode, self.fail_next, self.requests = model, max_logprobs, None, 0, []
        self.tamper = None  # (row {token id: logprob}, claimed id) -> the row sent for the first output token
        self.logits: dict[tuple, tuple] = {}
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": stub.model, "object": "model"}]})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                code, obj = stub.answer(req)
                self._send(code, obj)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, req):
        with self.lock:
            self.requests.append(tuple(req["prompt"]))
            if self.fail_next:
                self.fail_next -= 1
                return 503, {"error": {"message": "overloaded", "type": "ServiceUnavailable", "code": 503}}
        if req["model"] != self.model:
            return 404, {"error": {"message": f"The model `{req['model']}` does not exist.", "type": "NotFoundError",
                                   "code": 404}}
        k = req.get("prompt_logprobs")
        if k is not None and k > self.max_logprobs:
            return 400, {"error": {"message": f"Requested prompt logprobs of {k}, which is greater than max allowed: "
                                              f"{self.max_logprobs}", "type": "BadRequestError", "code": 400}}
        if self.mode == "not-json":
            return 200, b"<html>proxy error</html>"
        choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}
        if req.get("echo"):
            choice["logprobs"] = self.echo_logprobs(req["prompt"], req["logprobs"])
            return 200, {"id": "cmpl-stub", "object": "text_completion", "model": self.model, "choices": [choice]}
        if self.mode == "malformed":
            choice["prompt_logprobs"] = [None] * (len(req["prompt"]) - 1) + [{"5": {"logprob": "high"}}]
        elif k is not None and self.mode != "no-prompt-logprobs":
            choice["prompt_logprobs"] = self.prompt_logprobs(req["prompt"], k)
        return 200, {"id": "cmpl-stub", "object": "text_completion", "model": self.model, "choices": [choice]}

    def load(self, claims):
        """Compute the logits of every claim as local replay does (`Engine.replay_batches` with
        score_chunk's batch sizes: CPU GEMMs round by batch shape), so that only the log-softmax and
        the top-k cut separate the two paths."""
        pairs = [(c.prompt_token_ids, c.output_token_ids) for c in claims]
        _, batch_tokens, budget = replay_batch_size("cpu")
        for group, logits_NV, _ in self.engine.replay_batches(pairs, batch_tokens, None,
                                                              budget // self.engine.model.config.vocab_size):
            for i, l_TV in zip(group, logits_NV.split([len(pairs[i][1]) for i in group])):
                self.logits[tuple(pairs[i][0] + pairs[i][1])] = (len(pairs[i][0]), l_TV)

    def prompt_logprobs(self, ids, k):
        """vLLM's rows: fp32 log-softmax of the raw logits, top k + the actual token, rank 1-based,
        keyed by token id. Rows of prompt positions are null here (the reference reads only the
        output positions; vLLM fills them too)."""
        P, logits_TV = self.logits[tuple(ids)]
        lp_TV = torch.log_softmax(logits_TV.float(), -1)
        vals_Tk, ids_Tk = lp_TV.topk(k, -1)
        rows = [None] * P
        for t, y in enumerate(ids[P:]):
            row = {str(int(i)): {"logprob": float(v), "rank": r + 1, "decoded_token": "?"}
                   for r, (i, v) in enumerate(zip(ids_Tk[t], vals_Tk[t]))}
            row.setdefault(str(y), {"logprob": float(lp_TV[t, y]), "rank": int((lp_TV[t] > lp_TV[t, y]).sum()) + 1})
            if t == 0 and self.tamper is not None:
                new = self.tamper({int(i): e["logprob"] for i, e in row.items()}, y)
                row = {str(i): {"logprob": v, "rank": None} for i, v in new.items()}
            rows.append(row)
        return rows

    def echo_logprobs(self, ids, k):
        """OpenAI's legacy echo reply: per position the actual token's logprob and the top k keyed
        by token text (byte-level pieces that are not whole characters as "bytes:\\x.."), then the
        generated token."""
        from verinfer.retokenize import Retokenizer

        tb = Retokenizer.for_model(TARGET_DIR).token_bytes
        P, logits_TV = self.logits[tuple(ids)]
        lp_TV = torch.log_softmax(logits_TV.float(), -1)
        vals_Tk, ids_Tk = lp_TV.topk(k, -1)

        def text(i):
            b = tb.of_id(int(i))
            if b is None:  # a special token: its own text
                return next(t for t, j in tb.specials if j == int(i))
            try:
                return b.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

        token_lp = [None] * P + [float(lp_TV[t, y]) for t, y in enumerate(ids[P:])] + [-0.5]
        top = [None] * P + [{text(i): float(v) for i, v in zip(ids_Tk[t], vals_Tk[t])}
                            for t in range(len(ids) - P)] + [{"x": -0.5}]
        if self.tamper is not None:  # the first output token's row: its top k and the claimed token's own
            y, top_ids = ids[P], [int(i) for i in ids_Tk[0]]
            new = self.tamper({**{i: float(v) for i, v in zip(top_ids, vals_Tk[0])}, y: token_lp[P]}, y)
            top[P], token_lp[P] = {text(i): new[i] for i in top_ids}, new[y]
        return {"tokens": [text(i) for i in ids] + ["x"], "token_logprobs": token_lp, "top_logprobs": top,
                "text_offset": list(range(len(ids) + 1))}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def claims(tmp_path_factory):
    path = tmp_path_factory.mktemp("remote") / "claims.jsonl"
    out = []
    for j, (name, (t, k, p, m)) in enumerate(SETTINGS.items()):
        got = run_provider(HONEST["honest-bf16-b8"], TARGET_DIR, prompts_for(TARGET_DIR, 4, 30 + j),
                           SamplingParams(t, k, p, m, 0, 24, "vllm-cpu"), base_seed=30 + j)
        out += [c.__class__(f"{name}-{i}", c.model, c.prompt_token_ids, c.output_token_ids, c.sampling,
                            provider=name) for i, c in enumerate(got)]
        if name == "topk8":  # the same tokens claimed under seed + 1 and top-3: nonzero and infinite margins
            out += [c.__class__(f"wrong-seed-{i}", c.model, c.prompt_token_ids, c.output_token_ids,
                                replace(c.sampling, seed=c.sampling.seed + 1, top_k=3), provider="wrong-seed")
                    for i, c in enumerate(got)]
    write_claims(path, out)
    return path


@pytest.fixture(scope="module")
def tiny_claims(tmp_path_factory):
    """Two claims of arbitrary tokens: what the error cases send before any logits are needed."""
    from verinfer.claims import Claim
    from verinfer.models.load import model_info

    path = tmp_path_factory.mktemp("tiny") / "claims.jsonl"
    name = model_info(TARGET_DIR).name
    write_claims(path, [Claim(f"tiny-{i}", name, p, [5, 6, 7], SamplingParams(1.0, 8, 1.0, 0.0, i, 3, "vllm-cpu"))
                        for i, p in enumerate(prompts_for(TARGET_DIR, 2, 0))])
    return path


@pytest.fixture(scope="module")
def stub(claims):
    s = StubVllm()
    s.load(read_claims(claims))
    yield s
    s.close()


@pytest.fixture(scope="module")
def local(claims, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "local.parquet"
    return pq.read_table(score(claims, TARGET_DIR, out, show_progress=False, gaps=True).path)


def remote_score(claims, out, stub, **kw):
    kw = {"reference_model": "testbed", "reference_logprobs": K, "gaps": True, **kw}
    return pq.read_table(score(claims, TARGET_DIR, out, reference_url=stub.url, show_progress=False, **kw).path)


@pytest.fixture(scope="module")
def remote(claims, stub, tmp_path_factory):
    return remote_score(claims, tmp_path_factory.mktemp("remote") / "remote.parquet", stub)


@pytest.mark.slow  # 24 claims generated, replayed and served
def test_remote_scores_equal_local_replay(remote, local):
    """Same rows in the same order; on exact rows every score column equals local replay's (the
    margins to the fp32 rounding of the server's log-softmax), exact match equal; rows of claims
    whose filters may reach past k are marked approximate with a reason."""
    assert remote.num_rows == local.num_rows > 400
    for c in ("claim_id", "provider", "position", "token_id"):
        assert remote[c].equals(local[c]), c
    exact = ~remote["approximate"].to_numpy()
    reason = remote["approximate_reason"].to_pylist()
    prov = np.asarray(remote["provider"].to_pylist())
    assert all((r is None) == e for r, e in zip(reason, exact))
    assert not exact[np.isin(prov, ["topk50", "topp-only"])].any()  # top_k >= 20 or off: all marked
    assert exact[prov == "greedy"].all()
    assert exact[np.isin(prov, ["topk8", "topk12-minp", "wrong-seed"])].mean() > 0.9  # ties at the 20th value are rare
    assert {r.split(":")[0] for r in reason if r} >= {"top_k off", "top_k=50 >= the 20 logprobs asked"}
    for c in ("replay_token_id", "exact_match"):
        assert np.array_equal(remote[c].to_numpy()[exact], local[c].to_numpy()[exact]), c
    for c in ("margin", "cross_entropy", "likelihood", *gap_column_names()):
        a, b = remote[c].to_numpy()[exact], local[c].to_numpy()[exact]
        fin = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), fin) and np.array_equal(np.isnan(a), np.isnan(b)), c
        np.testing.assert_allclose(a[fin], b[fin], atol=2e-4, rtol=1e-5, err_msg=c)
    margin = remote["margin"].to_numpy()[exact]
    assert np.isfinite(margin).sum() > 300 and (np.isfinite(margin) & (margin > 0)).sum() > 10  # nonzero margins
    assert (~np.isfinite(margin)).sum() > 5                                                     # and filtered tokens
    assert remote["fp_l2"].null_count == remote.num_rows


def test_exactness_rule():
    v = np.array([-0.1, -1.0, -2.0, -3.0, -3.0])
    top3, top4 = SamplingParams(1.0, 3, 1.0, 0.0, 0), SamplingParams(1.0, 4, 1.0, 0.0, 0)
    assert exactness(v, top3, 5) is None
    assert "tie" in exactness(v, top4, 5)  # the 4th value ties the 5th: more may tie past the reply
    assert "top_k=5 >=" in exactness(v, SamplingParams(1.0, 5, 1.0, 0.0, 0), 5)
    assert exactness(v, SamplingParams(0.0, 0, 1.0, 0.0, None), 5) is None
    assert "top_k off" in exactness(v, SamplingParams(1.0, 0, 0.5, 0.0, 0), 5)
    assert exactness(v, SamplingParams(1.0, 0, 0.5, 0.0, 0), 8) is None  # 5 < 8: the whole vocabulary
    assert "min-p" in exactness(v, SamplingParams(1.0, 3, 1.0, float(np.exp(-0.9)), 0), 5)  # -1.0 vs max -0.1
    assert exactness(v, SamplingParams(1.0, 3, 1.0, 0.3, 0), 5) is None


@pytest.mark.slow
def test_retries_then_resumes_without_refetching(claims, stub, remote, tmp_path):
    """Two 503s are retried with backoff; a run stopped after its first part resumes and fetches
    only the claims of the parts not written."""
    from verinfer.audit.remote_reference import RemoteReference
    from verinfer.audit.replay import score_claims
    from verinfer.claims import iter_claims

    ref = RemoteReference.for_model_dir(stub.url, "testbed", TARGET_DIR, logprobs=K, concurrency=2)
    out = tmp_path / "r.parquet"
    kw = dict(chunk_claims=8, gaps=True)

    def stop(k):
        raise KeyboardInterrupt

    stub.fail_next, stub.requests = 2, []
    with pytest.raises(KeyboardInterrupt):
        score_claims(iter_claims(claims), ref, out, on_part=stop, **kw)
    assert len(stub.requests) == 8 + 2 and not out.exists()
    stub.requests = []
    score_claims(iter_claims(claims), ref, out, **kw)
    assert len(stub.requests) == 24 - 8  # parts 1 and 2 only
    got = pq.read_table(out)  # the uninterrupted run's table (parts of 8 claims: sums may group otherwise)
    assert got.schema == remote.schema and got.num_rows == remote.num_rows
    for c in got.column_names:
        a, b = got[c].to_numpy(zero_copy_only=False), remote[c].to_numpy(zero_copy_only=False)
        if got.schema.field(c).type == "double":
            np.testing.assert_allclose(a.astype(float), b.astype(float), rtol=1e-12, err_msg=c)
        else:
            assert np.array_equal(a, b), c


@pytest.mark.parametrize("case, what, fix", [
    ("dead", "cannot reach the reference server", "--reference-url"),
    ("model", "does not serve model 'other'", "--reference-model one of: testbed"),
    ("max-logprobs", "refuses 64 prompt logprobs", "--max-logprobs 64"),
    ("no-prompt-logprobs", "no prompt_logprobs", "vLLM server"),
    ("malformed", "malformed prompt_logprobs reply", "vLLM server"),
    ("not-json", "not JSON", "/v1"),
])
def test_errors_name_the_server_and_the_claim(tiny_claims, tmp_path, case, what, fix):
    stub = StubVllm()
    kw = {}
    url = stub.url
    if case == "dead":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # nothing listens there once closed
    if case == "model":
        kw["reference_model"] = "other"
    if case == "max-logprobs":
        kw["reference_logprobs"] = 64
    stub.mode = case if case in ("no-prompt-logprobs", "malformed", "not-json") else None
    try:
        with pytest.raises(ReferenceServerError) as e:
            score(tiny_claims, TARGET_DIR, tmp_path / "e.parquet", reference_url=url, show_progress=False,
                  **{"reference_model": "testbed", **kw})
    finally:
        stub.close()
    msg = e.value.message
    assert what in msg and fix in msg and url in msg, msg
    assert "claim '" in msg, msg


@pytest.mark.slow
def test_cli_reports_exact_and_approximate_rows(claims, stub, tmp_path):
    from typer.testing import CliRunner

    from verinfer.cli.main import app

    out = tmp_path / "cli.parquet"
    r = CliRunner().invoke(app, ["score", str(claims), "-o", str(out), "--reference-url", stub.url,
                                 "--reference-model", "testbed", "--reference-logprobs", str(K)])
    assert r.exit_code == 0, r.output
    t = pq.read_table(out)
    approx = int(np.sum(t["approximate"].to_numpy()))
    assert 0 < approx < t.num_rows
    assert f"{t.num_rows - approx} tokens exact, {approx} approximate" in r.output
    r = CliRunner().invoke(app, ["score", str(claims), "-o", str(tmp_path / "x.parquet"), "--reference-url", stub.url])
    assert r.exit_code != 0 and "--reference-model" in r.output


@pytest.mark.slow  # shares the module's 24 generated claims
def test_echo_reference_reads_token_texts(claims, stub, local, tmp_path):
    """A hosted completions API's echo with logprobs (top 5, keyed by token text): greedy rows are
    exact where the top-1 is above the 5th and then equal local replay; sampled rows with top_k >= 5
    are marked approximate."""
    r = remote_score(claims, tmp_path / "echo.parquet", stub, reference_protocol="echo", reference_logprobs=5)
    assert r.num_rows == local.num_rows and r["token_id"].equals(local["token_id"])
    prov = np.asarray(r["provider"].to_pylist())
    exact = ~r["approximate"].to_numpy()
    assert exact[prov == "greedy"].mean() > 0.95 and not exact[prov == "topk8"].any()
    g = exact & (prov == "greedy")
    for c in ("replay_token_id", "exact_match"):
        assert np.array_equal(r[c].to_numpy()[g], local[c].to_numpy()[g]), c
    np.testing.assert_allclose(r["margin"].to_numpy()[g], local["margin"].to_numpy()[g], atol=2e-4)


def _top(row: dict) -> int:
    return max(row, key=row.get)


IMPOSSIBLE = {  # kind: (the first output row a misbehaving server sends, what the error says)
    "unnormalized": (lambda r, y: {**r, **{i: -0.05 for i in sorted(r, key=r.get)[-2:]}}, "is not normalized"),
    "all-equal": (lambda r, y: {i: -10.0 for i in r}, "is degenerate: all"),
    "claimed-neg-inf": (lambda r, y: {**r, y: float("-inf")}, "logprob -inf for token 5 (the claimed token)"),
    "nan": (lambda r, y: {**r, next(i for i in r if i != y): float("nan")}, "logprob nan"),
    "positive": (lambda r, y: {**r, _top(r): 0.5}, "above 0"),
}


@pytest.fixture(scope="module")
def tiny_stub(tiny_claims):
    s = StubVllm()
    s.load(read_claims(tiny_claims))
    yield s
    s.close()


@pytest.mark.parametrize("protocol", ["prompt_logprobs", "echo"])
@pytest.mark.parametrize("kind", list(IMPOSSIBLE))
def test_impossible_rows_are_refused_before_scoring(tiny_claims, tiny_stub, tmp_path, kind, protocol):
    """A row no model's log-softmax gives (issue 34: these were scored, exit 0, exact match 0.97 /
    0.34 / 0.22 where local replay says 1.00) is an error naming the claim, its claims file line, the
    output position and what is wrong; no scores are written."""
    tamper, what = IMPOSSIBLE[kind]
    out = tmp_path / "e.parquet"
    tiny_stub.tamper = tamper
    try:
        with pytest.raises(ReferenceServerError) as e:
            score(tiny_claims, TARGET_DIR, out, reference_url=tiny_stub.url, show_progress=False,
                  reference_model="testbed", reference_logprobs=K, reference_protocol=protocol)
    finally:
        tiny_stub.tamper = None
    msg = e.value.message
    assert what in msg and f"{protocol} row of output token 0" in msg, msg
    assert f"claim 'tiny-0', {tiny_claims}:1" in msg and tiny_stub.url in msg, msg
    assert "not a faithful model server: score locally" in msg, msg
    assert not out.exists()


@pytest.mark.parametrize("protocol", ["prompt_logprobs", "echo"])
def test_honest_rows_of_the_same_claims_pass(tiny_claims, tiny_stub, tmp_path, protocol):
    """The untampered rows of the claims above score: the checks refuse nothing an honest server sends
    (the module's 24 claims pass them too, in the slow tests above)."""
    t = remote_score(tiny_claims, tmp_path / "ok.parquet", tiny_stub, reference_protocol=protocol, gaps=False)
    assert t.num_rows == 6 and t["token_id"].to_pylist() == [5, 6, 7] * 2


def test_impossible_row_rule():
    """Each value finite and <= 0, the probabilities summing to at most 1 (+1e-3), no degenerate
    row; exact ties of an honest bf16 model's top 2 (6% of the testbed's rows) pass."""
    from verinfer.audit.remote_reference import impossible_row

    honest = {3: -0.2, 9: -2.0, 4: -3.5}
    assert impossible_row(honest, 3) is None
    assert impossible_row({3: -1.5, 9: -1.5, 4: -3.5}, 3) is None            # a tie at the top
    assert impossible_row({3: -1.0, 9: -1.0}, 3) is None                     # two tied, 0.74 of the mass
    assert impossible_row({i: -5.0 for i in range(7)}, 3) is None            # 7 tied: rare, possible
    assert "degenerate" in impossible_row({i: -5.0 for i in range(8)}, 3)
    assert "degenerate" in impossible_row({3: float(-np.log(2)), 9: float(-np.log(2))}, 3)  # uniform over 2
    assert "not normalized" in impossible_row({3: -0.1, 9: -0.2}, 3)
    assert impossible_row({3: 0.0005, 9: -9.0}, 3) is None                   # rounding above 0
    assert "above 0" in impossible_row({3: 0.01, 9: -9.0}, 3)
    assert "(the claimed token), which is not finite" in impossible_row({3: float("-inf"), 9: -0.1}, 3)
    assert "not finite" in impossible_row({3: -0.1, 9: float("inf")}, 3)


@pytest.fixture(scope="module")
def unseeded_claims(tmp_path_factory):
    """Honest samples of the testbed claimed unseeded (`"seed": null`): top-k 8 (every kept token
    within the K = 20 logprobs a server returns) and top-k 50 (not)."""
    path = tmp_path_factory.mktemp("unseeded") / "claims.jsonl"
    out = []
    for name, top_k in (("topk8", 8), ("topk50", 50)):
        got = run_provider(HONEST["honest-bf16-b8"], TARGET_DIR, prompts_for(TARGET_DIR, 2, 7), SamplingParams(
            1.0, top_k, 0.95, 0.0, 0, 12, "vllm-cpu"), base_seed=7)
        out += [c.__class__(f"u-{name}-{i}", c.model, c.prompt_token_ids, c.output_token_ids,
                            replace(c.sampling, seed=None, unseeded=True), provider=name) for i, c in enumerate(got)]
    write_claims(path, out)
    return path


@pytest.fixture(scope="module")
def unseeded_stub(unseeded_claims):
    s = StubVllm()
    s.load(read_claims(unseeded_claims))
    yield s
    s.close()


def _claims_file(src, dst, keep):
    write_claims(dst, [c for c in read_claims(src) if keep(c)])
    return dst


def test_unseeded_claims_need_the_whole_kept_set(unseeded_claims, unseeded_stub, tmp_path):
    """An unseeded claim's PIT sums every kept token's probability: on top-k logprob rows it is
    refused before any request where its settings reach past the k returned (top-k 50 > K), and
    after the fetch where a row ties at the k-th value; where every row holds its kept set (top-k 8)
    its pit, entropy and cross-entropy equal local replay's."""
    from verinfer.errors import VerinferError

    wide = _claims_file(unseeded_claims, tmp_path / "wide.jsonl", lambda c: c.provider == "topk50")
    unseeded_stub.requests = []
    with pytest.raises(VerinferError) as e:
        remote_score(wide, tmp_path / "wide.parquet", unseeded_stub, gaps=False)
    msg = e.value.message
    assert f"claim 'u-topk50-0', {wide}:1" in msg and "unseeded" in msg and "top_k=50 >= the 20" in msg, msg
    assert "local reference" in msg and "--reference-logprobs" in msg, msg
    assert unseeded_stub.requests == [] and not (tmp_path / "wide.parquet").exists()

    narrow = _claims_file(unseeded_claims, tmp_path / "narrow.jsonl", lambda c: c.provider == "topk8")
    r = remote_score(narrow, tmp_path / "narrow.parquet", unseeded_stub, gaps=False)
    loc = pq.read_table(score(narrow, TARGET_DIR, tmp_path / "local.parquet", show_progress=False).path)
    assert r.num_rows == loc.num_rows == 24 and not r["approximate"].to_numpy().any()
    assert set(r["audit_mode"].to_pylist()) == {"unseeded"}
    for c in ("pit", "entropy", "cross_entropy"):
        np.testing.assert_allclose(r[c].to_numpy(), loc[c].to_numpy(), atol=1e-4, err_msg=c)

    def tie(row, y):  # the 8th to 20th largest logprobs made equal: the top-8 cut may reach past them
        order = sorted(row, key=row.get, reverse=True)
        return {**row, **{i: row[order[19]] for i in order[7:20]}}

    unseeded_stub.tamper = tie
    try:
        with pytest.raises(VerinferError) as e:
            remote_score(narrow, tmp_path / "tie.parquet", unseeded_stub, gaps=False)
    finally:
        unseeded_stub.tamper = None
    assert "claim 'u-topk8-0'" in e.value.message and "row of output token 0" in e.value.message, e.value.message
    assert "tie at the server's 20-th logprob" in e.value.message, e.value.message
