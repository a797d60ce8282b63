"""Batched inference over a KV cache: `prefill`, `decode_step`, `generate`, and `score`
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

from verinfer.errors import NumericsError
from verinfer.models.llama import KVCache, LlamaLM
from verinfer.numerics import Numerics
from verinfer.sampling.noise import get_backend
from verinfer.sampling.params import SamplingParams
from verinfer.sampling.sampler import sample_batch


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


def check_finite(logits: torch.Tensor, what: str) -> None:
    if not torch.isfinite(logits).all():
        bad = (~torch.isfinite(logits)).nonzero()[0].tolist()
        raise NumericsError(f"non-finite logits (NaN/inf) at index {bad} of {what}",
                            fix="check the weights and numerics (fp16 overflow? corrupted checkpoint?)")


class Engine:
    def __init__(self, model: LlamaLM, numerics: Numerics = Numerics(), eos_token_id: int | None = None,
                 packed_replay: bool = True):
        """packed_replay: `score` runs linear layers, norms and RoPE on the real tokens only,
        not on the padding of its length-sorted batches (LlamaLM's lengths_B)."""
        self.model = model
        self.packed_replay = packed_replay and isinstance(model, LlamaLM)
        self.numerics = numerics
        self.eos_token_id = eos_token_id
        self.vocab_size = model.config.vocab_size
        self.max_positions = model.config.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return self.model.device

    # --- prefill / decode ------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, requests: list[Request], extra_slots: int | None = None,
                hidden_layer: int | None = None) -> Batch:
        """Run the prompts (right-padded, optionally in chunks) and return the decoding state.
        With hidden_layer set, decode_step records, per row, the hidden state at the position
        that produced each sampled token (the rows `score(..., hidden_layer)` returns)."""
        B = len(requests)
        lens = [len(r.prompt_token_ids) for r in requests]
        for r, n in zip(requests, lens):
            if n == 0:
                raise ValueError(f"request {r.id}: empty prompt")
            if n + r.params.max_tokens > self.max_positions:
                raise ValueError(f"request {r.id}: prompt ({n}) + max_tokens ({r.params.max_tokens}) exceeds "
                                 f"the model's context of {self.max_positions} positions")
        T = max(lens)
        slots = T + (extra_slots if extra_slots is not None else max(r.params.max_tokens for r in requests)) + 1
        cache = self.model.new_cache(B, slots, self.numerics.kv_write_hook())
        tokens_BT = torch.zeros(B, T, dtype=torch.long)
        for b, r in enumerate(requests):
            tokens_BT[b, : lens[b]] = torch.tensor(r.prompt_token_ids)
        tokens_BT = tokens_BT.to(self.device)
        len_B = torch.tensor(lens, device=self.device)
        chunk = self.numerics.prefill_chunk or T
        last_BV = torch.empty(B, self.vocab_size, device=self.device)
        last_BD = None
        with self.numerics.threads_ctx():
            for c0 in range(0, T, chunk):
                c1 = min(T, c0 + chunk)
                pos_BT = torch.arange(c0, c1, device=self.device).expand(B, -1)
                logits_BTV, hidden_BTD = self.model(tokens_BT[:, c0:c1], pos_BT, cache, hidden_layer=hidden_layer)
                if hidden_BTD is not None and last_BD is None:
                    last_BD = torch.empty(B, hidden_BTD.shape[-1], dtype=torch.float32, device=self.device)
                for b in range(B):
                    if c0 <= lens[b] - 1 < c1:
                        last_BV[b] = logits_BTV[b, lens[b] - 1 - c0]
                        if hidden_BTD is not None:
                            last_BD[b] = hidden_BTD[b, lens[b] - 1 - c0].float()
        check_finite(last_BV, "prefill logits")
        streams = [None if r.params.greedy else
                   get_backend(r.params.noise).stream(r.params.seed, self.vocab_size, start_position=lens[b])
                   for b, r in enumerate(requests)]
        return Batch(requests, cache, len_B, last_BV, streams, [[] for _ in range(B)], [False] * B, [None] * B,
                     hidden_layer, last_BD, [[] for _ in range(B)])

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
    def extend(self, batch: Batch, tokens_BT: torch.Tensor, hidden_layer: int | None = None):
        """Append tokens_BT to every row (at its own positions) and return (logits_BTV, hidden)."""
        B, T = tokens_BT.shape
        pos_BT = batch.len_B[:, None] + torch.arange(T, device=self.device)[None, :]
        with self.numerics.threads_ctx():
            logits_BTV, hidden = self.model(tokens_BT.to(self.device), pos_BT, batch.cache, hidden_layer=hidden_layer)
        batch.len_B = batch.len_B + T
        return logits_BTV, hidden

    def rollback(self, batch: Batch, n_B: torch.Tensor) -> None:
        """Forget the last n_B[b] tokens of each row (their cache slots are overwritten later)."""
        batch.len_B = batch.len_B - n_B.to(batch.len_B.device)

    @torch.no_grad()
    def decode_step(self, batch: Batch, sampler=None) -> torch.Tensor:
        """Sample one token per unfinished row, record it, and run it through the model."""
        tokens_B = self.sample(batch, sampler).to(self.device)
        for b, r in enumerate(batch.requests):
            if batch.done_B[b]:
                continue
            tok = int(tokens_B[b])
            batch.outputs[b].append(tok)
            if batch.hidden_BD is not None:
                batch.hiddens[b].append(batch.hidden_BD[b].cpu())
            if self.eos_token_id is not None and tok == self.eos_token_id:
                batch.done_B[b], batch.finish[b] = True, "stop"
            elif len(batch.outputs[b]) >= r.params.max_tokens:
                batch.done_B[b], batch.finish[b] = True, "length"
        if not batch.finished:
            logits_BTV, hidden_BTD = self.extend(batch, tokens_B[:, None], hidden_layer=batch.hidden_layer)
            batch.logits_BV = logits_BTV[:, 0]
            if hidden_BTD is not None:
                batch.hidden_BD = hidden_BTD[:, 0].float()
            check_finite(batch.logits_BV[[b for b in range(len(batch.requests)) if not batch.done_B[b]]],
                         "decode logits")
        return tokens_B

    def generate(self, requests: list[Request], batch_size: int = 8, sampler=None,
                 progress=None, hidden_layer: int | None = None) -> list[Completion]:
        """Generate every request, `batch_size` at a time (static batches, in order). With
        hidden_layer, each Completion carries hidden_TD (fp32), the rows `score` replays."""
        out: list[Completion] = []
        for i in range(0, len(requests), batch_size):
            group = requests[i : i + batch_size]
            batch = self.prefill(group, hidden_layer=hidden_layer)
            while not batch.finished:
                self.decode_step(batch, sampler)
            for b, r in enumerate(group):
                h = torch.stack(batch.hiddens[b]) if hidden_layer is not None else None
                out.append(Completion(r.id, list(r.prompt_token_ids), batch.outputs[b], r.params, batch.finish[b], h))
            if progress is not None:
                progress(len(group))
        return out

    # --- replay ------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, pairs: list[tuple[list[int], list[int]]], batch_tokens: int = 2048,
              hidden_layer: int | None = None) -> list[Replay]:
        """Teacher-forced replay: for each (prompt, output) one forward over prompt+output[:-1]
        (claims batched together, sorted by length to limit padding; batches of about
        `batch_tokens` padded tokens: 2048 replays 1.2x faster than 8192 on a 2-core CPU, the
        activations stay in cache and attention pads less); returns the logits that
        each output token was sampled from, and hidden states at those steps if asked."""
        order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
        results: list[Replay | None] = [None] * len(pairs)
        group: list[int] = []

        def flush():
            if not group:
                return
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
            logits_NV = logits_NV.cpu()
            hidden_ND = hidden_ND.float().cpu() if hidden_ND is not None else None
            o = 0
            for i in group:
                n = len(pairs[i][1])
                results[i] = Replay(logits_NV[o : o + n], None if hidden_ND is None else hidden_ND[o : o + n])
                o += n
            group.clear()

        longest = 0
        for i in order:
            p, o = pairs[i]
            if not p or not o:
                raise ValueError(f"claim #{i}: empty prompt or output")
            n = len(p) + len(o) - 1
            if n > self.max_positions:
                raise ValueError(f"claim #{i}: prompt+output is {n + 1} tokens, over the model's context of "
                                 f"{self.max_positions}")
            if group and max(longest, n) * (len(group) + 1) > batch_tokens:
                flush()
                longest = 0
            group.append(i)
            longest = max(longest, n)
        flush()
        return results  # type: ignore[return-value]
