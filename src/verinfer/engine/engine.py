"""Batched inference over a KV cache: `prefill`, `decode_step`, `generate`, and `replay`
(teacher-forced replay of claimed tokens, one forward per claim, batched across claims).

Rows are right-padded; each row owns the cache slots 0..len-1 (slot = absolute position), so
mixed-length batches need no attention-mask bookkeeping beyond "key slot <= query position".
Each request carries its own SamplingParams and its own noise stream (sampling/noise.py),
so a request's tokens depend only on its seed and the logits, never on its batch neighbours'
randomness. The same state serves deterministic decoding (KV column read/overwrite,
`rollback`) and speculative decoding (multi-token `extend`, `rollback`).

Shape key: B=batch rows, T=tokens in a call, V=vocab, D=model dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verinfer.errors import NumericsError, VerinferError
from verinfer.models.llama import KVCache, LlamaLM
from verinfer.numerics import Numerics
from verinfer.sampling.noise import get_backend
from verinfer.sampling.params import SamplingParams, stop_reason
from verinfer.sampling.sampler import sample_batch


def refuse_unseeded(requests: list["Request"]) -> None:
    """A VerinferError naming the first request with unseeded SamplingParams: a sampled generation
    draws its noise from the request's seed; unseeded is an audit mode of received claims."""
    r = next((r for r in requests if r.params.unseeded), None)
    if r is not None:
        raise VerinferError("its sampling is unseeded (`\"seed\": null`), so there is no seed to draw the sampler's "
                            "noise from: unseeded is an audit mode of claims received from a provider, not a way "
                            "to generate", where=f"request {r.id!r}",
                            fix="give the request a seed (SamplingParams(seed=..., unseeded=False)) or sample at "
                                "temperature 0")


@dataclass
class Request:
    id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class Completion:
    id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    finish_reason: str  # "length" | "stop"
    hidden_TD: torch.Tensor | None = None  # with generate(hidden_layer=...): row t produced output token t


@dataclass
class Replay:
    """Teacher-forced replay of one claim: logits_TV[t] is the distribution the claimed
    output token t was drawn from (raw fp32 logits; `filtered()` applies the claim's filters)."""

    logits_TV: torch.Tensor
    hidden_TD: torch.Tensor | None = None

    def filtered(self, params: SamplingParams) -> torch.Tensor:
        from verinfer.sampling.filters import filter_logits

        T = self.logits_TV.shape[0]
        full = lambda v, dt: torch.full((T,), v, dtype=dt)  # noqa: E731
        return filter_logits(self.logits_TV, full(params.temperature, torch.float32),
                             full(params.top_k, torch.int64), full(params.top_p, torch.float32),
                             full(params.min_p, torch.float32))


@dataclass
class Batch:
    """Decoding state of a group of requests sharing one KV cache."""

    requests: list[Request]
    cache: KVCache
    len_B: torch.Tensor           # tokens in each row's sequence so far (= next slot)
    logits_BV: torch.Tensor       # next-token logits of each row
    streams: list                 # per-row noise stream (None for greedy rows)
    outputs: list[list[int]] = field(default_factory=list)
    done_B: list[bool] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    hidden_layer: int | None = None   # record hidden states (activation fingerprints)
    hidden_BD: torch.Tensor | None = None  # hidden state that produced logits_BV
    hiddens: list[list[torch.Tensor]] = field(default_factory=list)  # per row: one D-vector per output token

    @property
    def finished(self) -> bool:
        return all(self.done_B)


class RowsCache(KVCache):
    """A private copy of some rows of a KV cache: a verifier computes on it without touching the
    live cache; `commit(rows_i, slots)` copies chosen columns back (native K/V column repair)."""

    def __init__(self, parent: KVCache, rows: list[int]):
        idx = torch.tensor(rows, device=parent.k[0].device)
        self.parent, self.rows = parent, list(rows)
        self.k = [k.index_select(0, idx) for k in parent.k]
        self.v = [v.index_select(0, idx) for v in parent.v]
        self.max_slots = parent.max_slots
        self.write_hook = parent.write_hook

    @classmethod
    def stack(cls, caches: list["RowsCache"], slots: int) -> "RowsCache":
        """One cache holding the first `slots` slots of the rows of `caches`, in order (a copy; a
        kernel's bits depend on the slots it reads, not on how many a cache holds)."""
        out = object.__new__(cls)
        out.parent, out.rows = caches[0].parent, [r for c in caches for r in c.rows]
        out.k = [torch.cat([k[:, :slots] for k in ks]) for ks in zip(*(c.k for c in caches))]
        out.v = [torch.cat([v[:, :slots] for v in vs]) for vs in zip(*(c.v for c in caches))]
        out.max_slots, out.write_hook = slots, caches[0].write_hook
        return out

    def unstack(self, caches: list["RowsCache"]) -> None:
        """Copy each local row back into its own cache of `caches` (the inverse of `stack`)."""
        S = self.max_slots
        for i, c in enumerate(caches):
            for dst, src in zip(c.k + c.v, self.k + self.v):
                dst[:, :S] = src[i:i + 1]

    def commit(self, i: int, slot0: int, slot1: int) -> None:
        """Copy slots [slot0, slot1) of local row i into the parent's row."""
        r = self.rows[i]
        for pk, pv, k, v in zip(self.parent.k, self.parent.v, self.k, self.v):
            pk[r, slot0:slot1] = k[i, slot0:slot1]
            pv[r, slot0:slot1] = v[i, slot0:slot1]


def join(a: Batch, b: Batch) -> Batch:
    """One batch holding a's rows then b's rows, every field kept (a's cache grows in place;
    the caches must have the same slot count and both batches the same hidden_layer)."""
    if a.cache.max_slots != b.cache.max_slots:
        raise ValueError(f"cannot join caches with {a.cache.max_slots} and {b.cache.max_slots} slots; "
                         f"prefill both with the same extra_slots")
    if a.hidden_layer != b.hidden_layer:
        raise ValueError(f"cannot join batches recording hidden_layer {a.hidden_layer} and {b.hidden_layer}")
    a.cache.k = [torch.cat([x, y]) for x, y in zip(a.cache.k, b.cache.k)]
    a.cache.v = [torch.cat([x, y]) for x, y in zip(a.cache.v, b.cache.v)]
    hidden_BD = None if a.hidden_BD is None else torch.cat([a.hidden_BD, b.hidden_BD])
    return Batch(a.requests + b.requests, a.cache, torch.cat([a.len_B, b.len_B]),
                 torch.cat([a.logits_BV, b.logits_BV]), a.streams + b.streams, a.outputs + b.outputs,
                 a.done_B + b.done_B, a.finish + b.finish, a.hidden_layer, hidden_BD, a.hiddens + b.hiddens)


def select_rows(batch: Batch, keep: list[int]) -> Batch:
    """The batch with only rows `keep` (in this order), every field kept; the cache is cut in
    place (finished requests leave a continuous batch)."""
    idx = torch.tensor(keep, dtype=torch.long, device=batch.len_B.device)
    batch.cache.select_rows(idx)
    pick = lambda xs: [xs[i] for i in keep]  # noqa: E731
    hidden_BD = None if batch.hidden_BD is None else batch.hidden_BD[idx]
    return Batch(pick(batch.requests), batch.cache, batch.len_B[idx], batch.logits_BV[idx], pick(batch.streams),
                 pick(batch.outputs), pick(batch.done_B), pick(batch.finish), batch.hidden_layer, hidden_BD,
                 pick(batch.hiddens))


def check_finite(logits: torch.Tensor, what: str) -> None:
    if not torch.isfinite(logits).all():
        bad = (~torch.isfinite(logits)).nonzero()[0].tolist()
        raise NumericsError(f"non-finite logits (NaN/inf) at index {bad} of {what}",
                            fix="check the weights and numerics (fp16 overflow? corrupted checkpoint?)")


class Engine:
    def __init__(self, model: LlamaLM, numerics: Numerics = Numerics(), eos_token_id: int | None = None,
                 packed_replay: bool = True, lean_prefill: bool = False, stop_token_ids: tuple[int, ...] = ()):
        """eos_token_id and stop_token_ids: a row that samples one of them finishes ("stop").
        packed_replay: `replay` runs linear layers, norms and RoPE on the real tokens only,
        not on the padding of its length-sorted batches (LlamaLM's lengths_B).
        lean_prefill: prefill runs the lm_head only at the positions whose logits it returns (the
        speculative decoders' engines); False runs it at every position of each prefill chunk,
        the bits every recorded claim and reference was produced with. They differ in the last
        fp32 bits (on CPU the GEMM's row count changes its reduction; bf16 was equal on the testbed)."""
        self.model = model
        self.packed_replay = packed_replay and isinstance(model, LlamaLM)
        self.lean_prefill = lean_prefill
        self.numerics = numerics
        self.eos_token_id = eos_token_id
        self.stop_token_ids = frozenset(stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
        self.vocab_size = model.config.vocab_size
        self.max_positions = model.config.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return self.model.device

    # --- prefill / decode ------------------------------------------------------------
    def prefill(self, requests: list[Request], extra_slots: int | None = None,
                hidden_layer: int | None = None) -> Batch:
        """Run the prompts (right-padded, optionally in chunks) and return the decoding state.
        With hidden_layer set, decode_step records, per row, the hidden state at the position
        that produced each sampled token (the rows `replay(..., hidden_layer)` returns)."""
        return self.prefill_extend(requests, None, extra_slots, hidden_layer)[0]

    @torch.no_grad()
    def prefill_extend(self, requests: list[Request], append_BA: torch.Tensor | None, extra_slots: int | None = None,
                       hidden_layer: int | None = None, features_BTD: torch.Tensor | None = None,
                       hidden_all: bool = False) -> tuple[Batch, torch.Tensor, torch.Tensor | None]:
        """`prefill(requests)` followed by `extend(batch, append_BA)` in the SAME forward: row b's
        A appended tokens sit right after its own prompt (positions n_b..n_b+A-1). Returns
        (batch, logits_BTV, hidden_BTD) with T = A+1: the logits at positions n_b-1..n_b+A-1, the
        distribution of the first token after the prompt and after each appended one (speculative
        decoding's first verification fused with the target's prefill). append_BA None: A = 0.

        The batch's lengths count prompt + appended tokens and its logits_BV are logits_BTV[:, -1].
        With lean_prefill the lm_head runs only at those positions (the full [B, T, V] logits are a
        large share of a short prompt's prefill). `extra_slots` (default: the largest max_tokens)
        are cache slots past the longest prompt + A.

        features_BTD: a feature-level draft head's per-position input (speculative/feature_head.py),
        aligned with the right-padded prompts; hidden_all: hidden_BTD at EVERY position (prompt +
        appended, [B, T, D]) instead of the returned ones (the head's prefill reads the target's)."""
        refuse_unseeded(requests)
        B = len(requests)
        A = 0 if append_BA is None else append_BA.shape[1]
        lens = [len(r.prompt_token_ids) for r in requests]
        for r, n in zip(requests, lens):
            if n == 0:
                raise ValueError(f"request {r.id}: empty prompt")
            if n + A + r.params.max_tokens > self.max_positions:
                raise ValueError(f"request {r.id}: prompt ({n}) + max_tokens ({r.params.max_tokens}) exceeds "
                                 f"the model's context of {self.max_positions} positions")
        T = max(lens) + A
        slots = T + (extra_slots if extra_slots is not None else max(r.params.max_tokens for r in requests)) + 1
        cache = self.model.new_cache(B, slots, self.numerics.kv_write_hook())
        tokens_BT = torch.zeros(B, T, dtype=torch.long)
        for b, r in enumerate(requests):
            tokens_BT[b, : lens[b]] = torch.tensor(r.prompt_token_ids)
            if A:
                tokens_BT[b, lens[b] : lens[b] + A] = append_BA[b].cpu()
        tokens_BT = tokens_BT.to(self.device)
        # the (row, position) pairs whose logits are returned, row-major: n_b-1 .. n_b+A-1
        t_BT = torch.tensor(lens)[:, None] - 1 + torch.arange(A + 1)[None, :]
        b_BT = torch.arange(B)[:, None].expand(B, A + 1)
        logits_BTV = torch.empty(B, A + 1, self.vocab_size, device=self.device)
        hidden_BTD, hidden_chunks = None, []
        chunk = self.numerics.prefill_chunk or T
        with self.numerics.threads_ctx():
            for c0 in range(0, T, chunk):
                c1 = min(T, c0 + chunk)
                here_BT = (t_BT >= c0) & (t_BT < c1)
                b_N, t_N = b_BT[here_BT], t_BT[here_BT]
                pos_BT = torch.arange(c0, c1, device=self.device).expand(B, -1)
                select = (b_N.to(self.device), (t_N - c0).to(self.device))
                feats = None if features_BTD is None else features_BTD[:, c0:c1].to(self.device)
                logits_NV, hidden_ND = self.model(tokens_BT[:, c0:c1], pos_BT, cache, hidden_layer=hidden_layer,
                                                  select=select if self.lean_prefill else None,
                                                  **({"features_BTD": feats} if feats is not None else {}),
                                                  **({"hidden_all": True} if hidden_all else {}))
                if not self.lean_prefill:
                    logits_NV = logits_NV[select]
                    hidden_ND = None if (hidden_ND is None or hidden_all) else hidden_ND[select]
                logits_BTV[here_BT.to(self.device)] = logits_NV
                if hidden_all:
                    hidden_chunks.append(hidden_ND)
                elif hidden_ND is not None:
                    if hidden_BTD is None:
                        hidden_BTD = torch.empty(B, A + 1, hidden_ND.shape[-1], dtype=hidden_ND.dtype,
                                                 device=self.device)
                    hidden_BTD[here_BT.to(self.device)] = hidden_ND
        check_finite(logits_BTV, "prefill logits")
        if hidden_all:
            if hidden_layer is None:
                raise ValueError("hidden_all needs a hidden_layer")
            hidden_BTD = torch.cat(hidden_chunks, 1)
        len_B = torch.tensor(lens, device=self.device) + A
        streams = [None if r.params.greedy else
                   get_backend(r.params.noise).stream(r.params.seed, self.vocab_size, start_position=lens[b] + A)
                   for b, r in enumerate(requests)]
        batch = Batch(requests, cache, len_B, logits_BTV[:, -1], streams, [[] for _ in range(B)], [False] * B,
                      [None] * B, hidden_layer, None if hidden_BTD is None or hidden_all else hidden_BTD[:, -1].float(),
                      [[] for _ in range(B)])
        return batch, logits_BTV, hidden_BTD

    @torch.no_grad()
    def sample(self, batch: Batch, sampler=None) -> torch.Tensor:
        """Sample each row's next token from batch.logits_BV with its own params and noise.
        `sampler(logits_BV, params, noises, batch)` may replace the honest sampler
        (simulated misconfigurations)."""
        params = [r.params for r in batch.requests]
        noises = [None if (s is None or done) else s.next() for s, done in zip(batch.streams, batch.done_B)]
        fn = sampler or (lambda logits, p, n, _b: sample_batch(logits, p, n))
        return fn(batch.logits_BV, params, noises, batch)

    @torch.no_grad()
    def extend(self, batch: Batch, tokens_BT: torch.Tensor, hidden_layer: int | None = None,
               features_BTD: torch.Tensor | None = None):
        """Append tokens_BT to every row (at its own positions) and return (logits_BTV, hidden).
        features_BTD: a feature-level draft head's second input (speculative/feature_head.py)."""
        B, T = tokens_BT.shape
        pos_BT = batch.len_B[:, None] + torch.arange(T, device=self.device)[None, :]
        kw = {} if features_BTD is None else {"features_BTD": features_BTD.to(self.device)}
        with self.numerics.threads_ctx():
            logits_BTV, hidden = self.model(tokens_BT.to(self.device), pos_BT, batch.cache, hidden_layer=hidden_layer,
                                            **kw)
        batch.len_B = batch.len_B + T
        return logits_BTV, hidden

    def truncate(self, batch: Batch, len_B: torch.Tensor) -> None:
        """Keep the first len_B[b] tokens of each row's cache (KV-level rollback: the slots past
        them are overwritten by later writes and never attended to, key slot <= query position).
        The outputs decode_step recorded are not touched (`rollback_row` does that)."""
        batch.len_B = len_B.to(batch.len_B.device)

    def rollback(self, batch: Batch, n_B: torch.Tensor) -> None:
        """Forget the last n_B[b] tokens of each row's cache (`truncate` to len_B - n_B)."""
        self.truncate(batch, batch.len_B - n_B.to(batch.len_B.device))

    def rollback_row(self, batch: Batch, row: int, n_keep: int, logits_V: torch.Tensor,
                     hidden_D: torch.Tensor | None = None) -> None:
        """Row `row` keeps its first n_keep outputs and samples its next one from logits_V (e.g. a
        verifier's logits at the first mismatch): later outputs and their hidden states are dropped,
        the row is unfinished again and its cache holds prompt + n_keep tokens (the caller has
        written those K/V columns: a verifier's, see `recompute`)."""
        if batch.hidden_BD is not None and hidden_D is None:
            raise ValueError("this batch records hidden states: rollback_row needs the hidden state of logits_V")
        del batch.outputs[row][n_keep:]
        del batch.hiddens[row][n_keep:]
        batch.len_B[row] = len(batch.requests[row].prompt_token_ids) + n_keep
        batch.logits_BV[row] = logits_V
        if hidden_D is not None:
            batch.hidden_BD[row] = hidden_D.float()
        batch.done_B[row], batch.finish[row] = False, None

    @torch.no_grad()
    def recompute(self, batch: Batch, rows: list[int], tokens_NT: torch.Tensor,
                  pos_NT: torch.Tensor) -> tuple[torch.Tensor, RowsCache]:
        """Run tokens_NT at absolute positions pos_NT for batch rows `rows` (N of them) on a private
        copy of their KV cache, with this engine's model (a verifier recomputing steps another
        engine decoded): the batch is untouched. Returns (logits_NTV, scratch); the caller copies
        chosen K/V columns back with scratch.commit(i, slot0, slot1) (MarginGate's native repair,
        LLM-42's verified columns)."""
        scratch = RowsCache(batch.cache, rows)
        return self.run_on(scratch, tokens_NT, pos_NT), scratch

    @torch.no_grad()
    def run_on(self, cache: KVCache, tokens_NT: torch.Tensor, pos_NT: torch.Tensor) -> torch.Tensor:
        """Run tokens_NT at absolute positions pos_NT on `cache` (its rows, K/V written in place):
        logits_NTV. A verifier's own cache (MarginGate's prefix-only shadow) or a RowsCache."""
        with self.numerics.threads_ctx():
            logits_NTV, _ = self.model(tokens_NT.to(self.device), pos_NT.to(self.device), cache)
        return logits_NTV

    @torch.no_grad()
    def decode_step(self, batch: Batch, sampler=None) -> torch.Tensor:
        """Sample one token per unfinished row, record it, and run it through the model."""
        tokens_B = self.emit(batch, sampler)
        self.advance(batch, tokens_B)
        return tokens_B

    @torch.no_grad()
    def emit(self, batch: Batch, sampler=None) -> torch.Tensor:
        """The first half of `decode_step`: sample one token per unfinished row and record it
        (outputs, hidden state, finish reason by the stop rule, sampling.params.stop_reason)."""
        tokens_B = self.sample(batch, sampler).to(self.device)
        for b, r in enumerate(batch.requests):
            if batch.done_B[b]:
                continue
            tok = int(tokens_B[b])
            batch.outputs[b].append(tok)
            if batch.hidden_BD is not None:
                batch.hiddens[b].append(batch.hidden_BD[b].cpu())
            reason = stop_reason(tok, len(batch.outputs[b]), r.params.max_tokens, self.stop_token_ids)
            if reason is not None:
                batch.done_B[b], batch.finish[b] = True, reason
        return tokens_B

    @torch.no_grad()
    def advance(self, batch: Batch, tokens_B: torch.Tensor) -> None:
        """The second half of `decode_step`: run the emitted tokens through the model (unless
        every row has finished), giving each row's next logits."""
        if not batch.finished:
            logits_BTV, hidden_BTD = self.extend(batch, tokens_B[:, None], hidden_layer=batch.hidden_layer)
            batch.logits_BV = logits_BTV[:, 0]
            if hidden_BTD is not None:
                batch.hidden_BD = hidden_BTD[:, 0].float()
            check_finite(batch.logits_BV[[b for b in range(len(batch.requests)) if not batch.done_B[b]]],
                         "decode logits")

    def generate(self, requests: list[Request], batch_size: int = 8, sampler=None,
                 progress=None, hidden_layer: int | None = None, *, drop_finished: bool = False,
                 extra_slots: int | None = None) -> list[Completion]:
        """Generate every request, `batch_size` at a time (static batches, in order). With
        hidden_layer, each Completion carries hidden_TD (fp32), the rows `replay` replays.
        drop_finished: a finished row leaves the batch before the next forward (the speculative
        decoders' target-only baseline); by default it stays and is fed its last token (the bits
        every recorded claim was produced with). extra_slots: `prefill`'s. Unseeded SamplingParams
        are refused before any batch runs (`refuse_unseeded`)."""
        refuse_unseeded(requests)
        out: list[Completion] = []
        for i in range(0, len(requests), batch_size):
            group = requests[i : i + batch_size]
            batch = self.prefill(group, extra_slots=extra_slots, hidden_layer=hidden_layer)
            rows = list(range(len(group)))  # the group index of each batch row
            done: list[Completion | None] = [None] * len(group)
            while not batch.finished:
                tokens_B = self.emit(batch, sampler)
                if drop_finished and any(batch.done_B):
                    for b in (b for b, d in enumerate(batch.done_B) if d):
                        done[rows[b]] = _completion(batch, b)
                    keep = [b for b, d in enumerate(batch.done_B) if not d]
                    if not keep:
                        break
                    batch, tokens_B, rows = select_rows(batch, keep), tokens_B[keep], [rows[b] for b in keep]
                self.advance(batch, tokens_B)
            for b, g in enumerate(rows):
                done[g] = done[g] or _completion(batch, b)
            out += done  # type: ignore[arg-type]
            if progress is not None:
                progress(len(group))
        return out

    # --- replay ------------------------------------------------------------------------
    @torch.no_grad()
    def forward_sequence(self, tokens_T: list[int], hidden_layer: int | None = None):
        """One sequence teacher-forced without a cache: (logits_TV fp32, hidden_TD or None) at
        EVERY position (row t: the distribution of token t+1). For checks that read each position
        of one sequence (AutoJudge mining, speculative-claim checks); `replay` batches many claims
        and returns their output positions only."""
        tokens_1T = torch.tensor([tokens_T], device=self.device)
        with self.numerics.threads_ctx():
            logits_1TV, hidden_1TD = self.model(tokens_1T, torch.arange(len(tokens_T), device=self.device)[None],
                                                hidden_layer=hidden_layer)
        return logits_1TV[0], None if hidden_1TD is None else hidden_1TD[0]

    @torch.no_grad()
    def replay_batches(self, pairs: list[tuple[list[int], list[int]]], batch_tokens: int = 2048,
                       hidden_layer: int | None = None, max_rows: int | None = None):
        """Teacher-forced replay, one forward batch at a time, results left on the model's device:
        yields (group, logits_NV, hidden_ND) where group lists the indices of `pairs` in the batch
        and row block i of logits_NV (len(pairs[group[i]][1]) rows, in group order) holds the logits
        each claimed output token of pairs[group[i]] was sampled from. Claims are sorted by length to
        limit padding; a batch holds about `batch_tokens` padded tokens (2048 replays 1.2x faster
        than 8192 on a 2-core CPU: the activations stay in cache and attention pads less) and at
        most `max_rows` output rows (bounds the [rows, V] logits of a large vocabulary)."""
        order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
        group: list[int] = []

        def forward():
            seqs = [pairs[i][0] + pairs[i][1][:-1] for i in group]
            T = max(len(s) for s in seqs)
            tokens_BT = torch.zeros(len(seqs), T, dtype=torch.long)
            for b, s in enumerate(seqs):
                tokens_BT[b, : len(s)] = torch.tensor(s)
            pos_BT = torch.arange(T).expand(len(seqs), -1)
            lengths_B = torch.tensor([len(s) for s in seqs])
            b_N = torch.cat([torch.full((len(pairs[i][1]),), b) for b, i in enumerate(group)])
            t_N = torch.cat([torch.arange(len(pairs[i][0]) - 1, len(pairs[i][0]) - 1 + len(pairs[i][1]))
                             for i in group])
            with self.numerics.threads_ctx():
                logits_NV, hidden_ND = self.model(tokens_BT.to(self.device), pos_BT.to(self.device), None,
                                                  hidden_layer=hidden_layer,
                                                  select=(b_N.to(self.device), t_N.to(self.device)),
                                                  **({"lengths_B": lengths_B} if self.packed_replay else {}))
            # a finite sum means every logit is finite (46 ms -> 1.5 ms on 4096 x 2048); an
            # overflowing sum of finite logits falls through to the exact check
            if not torch.isfinite(logits_NV.sum()) and not torch.isfinite(logits_NV).all():
                bad = int((~torch.isfinite(logits_NV)).any(-1).nonzero()[0, 0])
                b = int(b_N[bad])
                check_finite(logits_NV[bad], f"replay of claim #{group[b]} at output position "
                                              f"{int(t_N[bad]) - len(pairs[group[b]][0]) + 1}")
            return list(group), logits_NV, hidden_ND

        longest = rows = 0
        for i in order:
            p, o = pairs[i]
            if not p or not o:
                raise ValueError(f"claim #{i}: empty prompt or output")
            n = len(p) + len(o) - 1
            if n > self.max_positions:
                raise ValueError(f"claim #{i}: prompt+output is {n + 1} tokens, over the model's context of "
                                 f"{self.max_positions}")
            if group and (max(longest, n) * (len(group) + 1) > batch_tokens
                          or (max_rows is not None and rows + len(o) > max_rows)):
                yield forward()
                group.clear()
                longest = rows = 0
            group.append(i)
            longest, rows = max(longest, n), rows + len(o)
        if group:
            yield forward()

    def replay(self, pairs: list[tuple[list[int], list[int]]], batch_tokens: int = 2048,
               hidden_layer: int | None = None) -> list[Replay]:
        """Teacher-forced replay (`replay_batches`) gathered per claim on the host: the logits
        each output token was sampled from, and hidden states at those steps if asked. For
        scoring at the device's speed use `replay_batches` (audit/replay.py does)."""
        results: list[Replay | None] = [None] * len(pairs)
        for group, logits_NV, hidden_ND in self.replay_batches(pairs, batch_tokens, hidden_layer):
            logits_NV = logits_NV.cpu()
            hidden_ND = hidden_ND.float().cpu() if hidden_ND is not None else None
            o = 0
            for i in group:
                n = len(pairs[i][1])
                results[i] = Replay(logits_NV[o : o + n], None if hidden_ND is None else hidden_ND[o : o + n])
                o += n
        return results  # type: ignore[return-value]



def _completion(batch: Batch, b: int) -> Completion:
    """Row b of a batch as a Completion (hidden_TD: the recorded hidden states, if any)."""
    r = batch.requests[b]
    h = torch.stack(batch.hiddens[b]) if batch.hidden_layer is not None else None
    return Completion(r.id, list(r.prompt_token_ids), batch.outputs[b], r.params, batch.finish[b], h)
