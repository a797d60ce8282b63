"""The models a server serves, looked up by name only.

`--model DIR` is either one model directory (config.json inside) or a directory whose direct
subdirectories are model directories. Every model is found and loaded at start-up and put in a
name -> ServedModel table (its `verinfer_name` / config name and its directory name); a request's
`model` field is only ever a key into that table, never joined into a path, so no request can
make the server touch a file outside the configured directory.

A served model can be misconfigured on purpose (`misconfig`, one of the simulated providers'
misconfigurations in providers/simulated.py) so audits of a real HTTP endpoint can be tested:
int4 and fp8-kv change the numerics the model runs with, temp-1.1 samples at temperature 1.1
whenever a request asks for a temperature > 0, wrong-seed samples with seed + 1, sampling-bug
draws 1% of tokens uniformly from the top-k. Responses always report the requested settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from verinfer.providers.simulated import MISCONFIGURED, ProviderConfig
from verinfer.determinism.invariant import fixed_shape_model
from verinfer.engine.engine import Engine
from verinfer.errors import ModelError
from verinfer.models.load import ModelInfo, load_model, load_tokenizer, model_info
from verinfer.numerics import Numerics

HONEST_NUMERICS = Numerics(dtype="bf16", attn="sdpa", matmul="split-k")  # batch effects as on a GPU
MAX_MODELS = 8


@dataclass
class ServedModel:
    name: str
    info: ModelInfo
    engine: Engine            # stops at EOS
    engine_no_eos: Engine     # same weights, for ignore_eos requests
    tokenizer: object
    provider: ProviderConfig  # honest (bf16) or one of MISCONFIGURED
    aliases: list[str] = field(default_factory=list)

    @property
    def context(self) -> int:
        return self.info.max_positions


def provider_for(misconfig: str | None) -> ProviderConfig:
    if misconfig is None:
        return ProviderConfig("honest", HONEST_NUMERICS)
    if misconfig not in MISCONFIGURED:
        raise ModelError(f"unknown misconfiguration {misconfig!r}", where="--misconfig",
                         fix=f"choose one of {', '.join(MISCONFIGURED)} (or omit it for an honest server)")
    return MISCONFIGURED[misconfig]


def _model_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        raise ModelError("no such model directory", where=str(root), fix="pass --model DIR (a save_pretrained directory)")
    if (root / "config.json").is_file():
        return [root]
    dirs = sorted(p for p in root.iterdir() if p.is_dir() and (p / "config.json").is_file()
                  and any(p.glob("*.safetensors")))
    if not dirs:
        raise ModelError("neither a model directory (config.json) nor a directory of model directories",
                         where=str(root), fix="pass --model DIR pointing at a save_pretrained directory")
    if len(dirs) > MAX_MODELS:
        raise ModelError(f"{len(dirs)} model directories; a server loads at most {MAX_MODELS}", where=str(root),
                         fix="point --model at a directory with fewer models")
    return dirs


DETERMINISTIC = ("best", "margingate")  # server/app.py's docstring


def load_registry(root: str | Path, *, misconfig: str | None = None, device: str = "cpu",
                  deterministic: str | None = None) -> dict[str, ServedModel]:
    """name -> ServedModel for every model under `root` (its model name, the aliases its checkpoint
    records (ModelInfo.aliases) and its directory name are keys). Raises ModelError on anything
    unloadable, before the server starts.

    deterministic="best": every model decodes on the fixed-shape deterministic path
    (LlamaLM on numerics/kernels.FixedShape, certified for this machine at the current thread count),
    so a greedy request's tokens are the determinism reference's, the tokens
    `verinfer generate --deterministic best` gives it in any batch. "margingate": the models stay on
    the server's numerics (the batch's verifier, server/batching.py, runs the fixed-shape path)."""
    if deterministic not in (None, *DETERMINISTIC):
        raise ModelError(f"unknown deterministic mode {deterministic!r}", where="--deterministic",
                         fix=f"use one of {', '.join(DETERMINISTIC)} (or leave it off)")
    cfg = provider_for(misconfig)
    table: dict[str, ServedModel] = {}
    for d in _model_dirs(Path(root).resolve()):
        info = model_info(d)
        model = load_model(d, cfg.numerics, device)
        if deterministic == "best":
            model = fixed_shape_model(model)
        tok = load_tokenizer(d)
        names = list(dict.fromkeys([*info.aliases, d.name]))
        sm = ServedModel(info.name, info, Engine(model, cfg.numerics, eos_token_id=info.eos_token_id),
                         Engine(model, cfg.numerics, eos_token_id=None), tok, cfg, names)
        for n in names:
            if n in table:
                raise ModelError(f"two models answer to the name {n!r}", where=str(d),
                                 fix="give them distinct verinfer_name entries in config.json")
            table[n] = sm
    return table
