"""What `eaglepipe` does with its arguments before Hydra sees them: the command word, the help pages, the two
spellings of a command, options that are not Hydra's, and bash completion of commands.

`route(argv)` returns the text of a help page to print, or the arguments to hand to Hydra; a mistake raises
UserError (one line, exit 2: `eaglepipe verfy` -> "did you mean verify?", `eaglepipe verify --bogus`, `--help`
after settings). `complete(line, hydra)` answers bash's completion query (`eaglepipe -sc query=bash`, which
the script of `eval "$(eaglepipe -sc install=bash)"` asks): commands, `stage=` values, and Hydra's own
completion of config groups and keys for the rest."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.commands import NAMES, canonical, is_command, spelt, unknown
from pipeline.errors import UserError

HELP = ("-h", "--help")
COMPLETION = ("-sc", "--shell-completion")


def hydra_options() -> dict[str, object]:
    """Hydra's own options (its argparse parser): option string -> its action."""
    from hydra._internal.utils import get_args_parser

    return dict(get_args_parser()._option_string_actions)


def _positions(args: list[str]) -> list[int]:
    """Indexes of the words that are neither an option nor an option's value (`--cfg job`, `-cd DIR`)."""
    options, out, i = hydra_options(), [], 0
    while i < len(args):
        a = args[i]
        action = options.get(a.split("=", 1)[0]) if a.startswith("-") else None
        if action is not None and "=" not in a and action.nargs is None and i + 1 < len(args):
            i += 1  # its value
        elif action is not None and action.nargs == "?" and i + 1 < len(args):
            i += args[i + 1] in (action.choices or ())
        elif not a.startswith("-"):
            out.append(i)
        i += 1
    return out


def route(argv: list[str]) -> str | list[str]:
    """A help page (str) or Hydra's arguments (`verify x=1` -> `stage=verify x=1`)."""
    from pipeline import cli_help

    args = list(argv)
    if "--hydra-help" in args:
        return args
    if args[:1] == ["help"]:
        if len(args) > 2:
            raise UserError(
                f"help takes one command, e.g. eaglepipe help verify (found {' '.join(args[1:])})"
            )
        return cli_help.command_help(command(args[1])) if len(args) == 2 else cli_help.main_page()
    name = None
    words = _positions(args)
    if words and "=" not in args[words[0]]:  # `eaglepipe verify ...` is `eaglepipe stage=verify ...`
        name = command(args[words[0]])
        args[words[0]] = f"stage={name}"
    for i, a in enumerate(args):
        key, eq, value = a.partition("=")
        if eq and key.lstrip("+~") == "stage" and "$" not in value:  # -m stage=a,b sweeps: each spelt
            stages = [command(v) for v in value.split(",")]
            args[i] = f"{key}={','.join(stages)}"
            name = stages[0] if len(stages) == 1 else name
    if any(a in HELP for a in args):
        return _help(args, name)
    options = hydra_options()
    for a in args:
        if a.startswith("-") and a.split("=", 1)[0] not in options:
            where = f" for {spelt(name)}" if name else ""
            raise UserError(
                f"unknown option {a}{where}: settings are key=value (eaglepipe {spelt(name or '')} --help "
                "lists them); eaglepipe's options are Hydra's (eaglepipe --hydra-help)".replace("  ", " ")
            )
    # options first, then the overrides together: Hydra's parser takes one run of overrides, so
    # `verify --cfg job x=1` (and the tools' own hydra.* overrides the entry point appends) would be refused
    words = set(words)  # rewriting a command word or a stage= value moves no position
    return [a for i, a in enumerate(args) if i not in words] + [a for i, a in enumerate(args) if i in words]


def command(word: str) -> str:
    """A command in the config's spelling, typed either way; a word that is none: one line, the nearest."""
    if not is_command(word):
        raise UserError(unknown(word))
    return canonical(word)


def _help(args: list[str], name: str | None) -> str:
    from pipeline import cli_help

    settings = [a for a in args if a not in HELP and not a.startswith("stage=")]
    if settings:
        cmd = f"eaglepipe {spelt(name)}" if name else "eaglepipe"
        raise UserError(
            f"--help comes right after the command, not after settings ({' '.join(settings)}): {cmd} --help; "
            f"the config those settings make: {cmd} {' '.join(settings)} --cfg job"
        )
    return cli_help.command_help(name) if name else cli_help.main_page()


def is_completion_query(args: list[str]) -> bool:
    return any(a in COMPLETION for a in args) and any(a.startswith("query=") for a in args)


def complete(line: str, hydra: Callable[[str], list[str]]) -> list[str]:
    """Bash's candidates for the last word of `line` (COMP_LINE): a command in the first position, a
    command after `stage=`, and Hydra's completion (config groups, keys, group options: `hydra(line)`) of
    the line without its command word, since Hydra reads every word as an override. Schema entries
    (`target=base_target`) are not options and are left out."""
    words = line.split()
    current = "" if not words or line.endswith(" ") else words[-1]
    before = words[1:] if line.endswith(" ") else words[1:-1]
    if current.startswith("stage="):
        return [f"stage={spelt(n)}" for n in NAMES if spelt(n).startswith(current[6:])]
    found = []
    if (
        not [w for w in before if not w.startswith("-")]
        and not current.startswith("-")
        and "=" not in current
    ):
        found = [spelt(n) for n in NAMES if spelt(n).startswith(current)]
    kept = [w for w in before if w.startswith("-") or "=" in w]  # the command word is no override
    hydra_line = " ".join([words[0] if words else "eaglepipe", *kept, current])
    hydra_found = hydra(hydra_line if current else hydra_line + " ")
    # experiment is in no defaults list: it is added (+experiment=demo)
    found += ["+" + c if c.startswith("experiment=") else c for c in hydra_found if "=base_" not in c]
    return found
