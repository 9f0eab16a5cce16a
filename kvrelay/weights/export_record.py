"""What ``kvrelay export-hf`` records in a folder it writes (kvrelay.json): the model it was exported from and the
fingerprint that model's relay layer profile is found under, with the weights file's hash, so that a folder whose
weights were changed is a model of its own."""

from __future__ import annotations

import json
from pathlib import Path

from kvrelay.weights.integrity import file_sha256

WEIGHTS_FILE = "model.safetensors"
EXPORT_RECORD = "kvrelay.json"


def exported_profile_fingerprint(folder: str | Path, weights_sha256: str | None = None) -> str | None:
    """The profile fingerprint ``export_hf`` recorded in ``folder``, when its weights file is still the exported one
    (a folder whose weights were changed is a model of its own: None). ``weights_sha256``: the weights file's hash,
    if the caller has it already."""
    folder = Path(folder)
    try:
        record = json.loads((folder / EXPORT_RECORD).read_text())
        if record["weights_sha256"] == (weights_sha256 or file_sha256(folder / WEIGHTS_FILE)):
            return str(record["profile_fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None
