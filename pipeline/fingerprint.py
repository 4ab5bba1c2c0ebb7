"""The one digest every stage fingerprint and content hash uses (16 hex chars of sha256 over canonical JSON),
and the config section a fingerprint hashes: its keys minus the knobs a stage lists as not shaping its
output."""

import hashlib
import json


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def shaping(section, leave_out: tuple[str, ...] = ()) -> dict:
    """A config section as plain data (enums as their names) without the keys in `leave_out`; each of those
    must be a key of the section, so a renamed knob cannot silently slip back into a fingerprint."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(section, resolve=True, enum_to_str=True)
    unknown = sorted(set(leave_out) - set(data))
    if unknown:
        raise KeyError(f"not keys of this config section: {unknown}")
    return {k: v for k, v in data.items() if k not in leave_out}
