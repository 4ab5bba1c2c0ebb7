"""The one digest every stage fingerprint and content hash uses (16 hex chars of sha256 over canonical JSON)."""

import hashlib
import json


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]
