"""The commands of `eaglepipe`, one home: the stages in data-flow order, the tools, and how each is spelt.

The config's Stage enum (config_choices), the runner, the help pages (cli_help: a test fails when a command
has no page) and shell completion (cli) are all keyed on these lists. A command is spelt with `-` on the
command line and in the docs (`check-store`, `tune-serve`); the config value and the module use `_`
(`stage=check_store`, pipeline/tools/check_store.py). Both spellings are accepted everywhere."""

import difflib

# the six stages, in data-flow order: `all` runs them, each writes one folder of the run dir
ORDER = ["prepare", "extract", "vocab", "train", "export", "evaluate"]
# read an export or a store; no fingerprints, never part of `all` (pipeline/tools/)
TOOLS = ["verify", "serve", "doctor", "parity", "check_store", "plan", "tune_serve"]
# `all`: the stages in ORDER, those up to date skipped; `submit`: the same as a chain of SLURM jobs
RUNS = ["all", "submit"]
NAMES = [*ORDER, *RUNS, *TOOLS]  # every value of `stage=`


def spelt(name: str) -> str:
    """The spelling users type and read (`check-store`)."""
    return name.replace("_", "-")


def canonical(word: str) -> str:
    """The config's spelling of a command typed either way (`check-store`, `check_store` -> `check_store`)."""
    return word.replace("-", "_")


def is_command(word: str) -> bool:
    return canonical(word) in NAMES


def unknown(word: str) -> str:
    """The one line for a word that is no command: the nearest command, and every command."""
    near = difflib.get_close_matches(canonical(word), NAMES, n=1, cutoff=0.6)
    hint = f"did you mean {spelt(near[0])}? " if near else ""
    return (
        f"{word!r} is not an eaglepipe command; {hint}commands: {', '.join(spelt(n) for n in NAMES)} "
        "(eaglepipe --help says what each does)"
    )
