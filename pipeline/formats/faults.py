"""What goes wrong with files, as one line (issue #35, rule 4). Pure module.

A damaged artifact: the typed readers of formats/ read through `reading`, `read_json` and `load_safetensors`,
so a JSON file cut short or emptied, a safetensors file truncated, an arrow file with a changed byte, a folder
where a file belongs become a UserError naming the path and the fix, never the parser's traceback. What a
missing file means stays each reader's own business (usually a stage not yet run): these are for files that
are there.

A full disk: `disk_full` recognises ENOSPC in whatever form the writer reports it (Python's OSError,
tensorstore's RESOURCE_EXHAUSTED, safetensors' "os error 28", torch's zip writer, which says only that its
stream failed) and says it in one line. Every writer writes under a temporary name and renames when complete,
so a failed write leaves nothing that looks finished.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

# what reading a damaged file raises: OSError (unreadable, a folder where a file belongs), ValueError
# (json.JSONDecodeError, UnicodeDecodeError, pyarrow's ArrowInvalid); safetensors' own error where it reads
READ_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError)


def why(e: BaseException) -> str:
    """An exception as a short phrase of one line."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"


def damaged(path, fix: str, what: str) -> UserError:
    return UserError(f"{path} is damaged ({what}): {fix}")


@contextmanager
def reading(path, fix: str, errors: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """What the block raises reading `path` (READ_ERRORS and `errors`) as one line naming it and the fix."""
    try:
        yield
    except UserError:
        raise
    except READ_ERRORS + errors as e:
        raise damaged(path, fix, why(e)) from None


def read_json(
    path, fix: str, valid: Callable[[Any], bool] = lambda v: isinstance(v, dict), what: str = "a JSON object"
) -> Any:
    """A JSON file that parses and is `what` (checked by `valid`), or one line naming it and the fix."""
    with reading(path, fix):
        value = json.loads(Path(path).read_text())
    if not valid(value):
        raise damaged(path, fix, f"not {what}")
    return value


def load_safetensors(path, fix: str) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    with reading(path, fix, (SafetensorError,)):
        return load_file(str(path))


# ------------------------------------------------------------------------------------------------ disk full
_NO_SPACE = ("No space left on device", "os error 28", "os_error_code='28'", "StorageFull")
_QUIET = 1 << 20  # torch's zip writer names no errno: a file system with less than this free is the cause


def disk_full(e: BaseException, folder) -> str | None:
    """One line for a write that failed because the disk of `folder` (the run dir) is full; else None."""
    chain, x = [], e
    while x is not None and len(chain) < 8:
        chain.append(x)
        x = x.__cause__ or x.__context__
    said = [c for c in chain if isinstance(c, OSError) and c.errno == errno.ENOSPC]
    said += [c for c in chain if any(s in str(c) for s in _NO_SPACE)]
    if not said and not (isinstance(e, (OSError, RuntimeError, ValueError)) and _free(folder) < _QUIET):
        return None
    named = [c.filename for c in said if isinstance(c, OSError) and c.filename]
    named += re.findall(r'writing local file "([^"]+)"', " ".join(map(str, said)))
    where = named[0] if named else folder
    return (
        f"disk full while writing {where} ({_free(folder) / 1e6:.1f} MB free on the file system of "
        f"{folder}): "
        "free space there and rerun the same command; finished work is kept (committed shards, complete "
        "checkpoints: the rerun resumes from them)"
    )


def _free(folder) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 1 << 62
