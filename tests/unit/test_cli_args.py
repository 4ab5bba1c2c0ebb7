"""pipeline/cli.py: the command word and its spelling, a misspelt command, an option that is not Hydra's,
--help after settings (each one line, exit 2, no traceback, through the real entry point), and bash
completion of commands, stage= values and config keys (in bash itself, through Hydra's install script)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cli
from pipeline.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # where `make setup` installed the `eaglepipe` script


def eaglepipe(*args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "eaglepipe"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def one_error_line(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and r.stdout == "", r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eaglepipe: error: "), r.stderr
    return lines[0]


def test_a_misspelt_command_names_the_nearest_one():
    line = one_error_line(eaglepipe("verfy", "export_dir=x"))
    assert "'verfy' is not an eaglepipe command; did you mean verify?" in line
    assert "check-store" in line and "check_store" not in line  # the list in the README's spelling
    assert "did you mean tune-serve?" in one_error_line(eaglepipe("stage=tune-srve"))


def test_an_option_that_is_not_hydras_is_one_line():
    line = one_error_line(eaglepipe("verify", "--bogus"))
    assert line == (
        "eaglepipe: error: unknown option --bogus for verify: settings are key=value (eaglepipe verify "
        "--help lists them); eaglepipe's options are Hydra's (eaglepipe --hydra-help)"
    )


def test_help_after_settings_says_where_help_goes_and_how_to_see_the_config():
    line = one_error_line(eaglepipe("verify", "export_dir=runs/x/export/sglang", "--help"))
    assert (
        "--help comes right after the command, not after settings (export_dir=runs/x/export/sglang)" in line
    )
    assert (
        "eaglepipe verify --help" in line
        and "eaglepipe verify export_dir=runs/x/export/sglang --cfg job" in line
    )


def test_a_tools_config_prints_with_options_after_the_command():
    """`eaglepipe check-store --cfg job run_dir=x` once ended in argparse's "unrecognized arguments:
    hydra.output_subdir=null ..." (the tools' own overrides were appended after the option)."""
    r = eaglepipe("check-store", "--cfg", "job", "run_dir=/tmp/x")
    assert r.returncode == 0 and "stage: check_store" in r.stdout and "run_dir: /tmp/x" in r.stdout, r.stderr


def test_help_of_a_word_that_is_no_command_is_one_line():
    assert "'nope' is not an eaglepipe command" in one_error_line(eaglepipe("help", "nope"))


def test_the_command_word_and_stage_values_are_taken_in_either_spelling():
    assert cli.route(["check-store", "run_dir=x"]) == ["stage=check_store", "run_dir=x"]
    assert cli.route(["-m", "tune-serve", "x=1"]) == ["-m", "stage=tune_serve", "x=1"]
    assert cli.route(["--cfg", "job", "stage=check-store"]) == ["--cfg", "job", "stage=check_store"]
    assert cli.route(["-m", "stage=train,export"]) == ["-m", "stage=train,export"]
    # options before the overrides, which Hydra takes as one run (a tool's hydra.* overrides are appended)
    assert cli.route(["check-store", "--cfg", "job", "run_dir=x"]) == [
        "--cfg",
        "job",
        "stage=check_store",
        "run_dir=x",
    ]
    assert cli.route(["target=tiny"]) == ["target=tiny"]
    with pytest.raises(UserError, match="did you mean evaluate"):
        cli.route(["-m", "stage=train,evalute"])


def test_completion_offers_commands_first_then_hydras_keys_without_the_command_word():
    asked = []

    def hydra(line):
        asked.append(line)
        return ["target=base_target", "target=tiny", "train.lr=", "experiment=demo"]

    assert cli.complete("eaglepipe ch", hydra)[:1] == ["check-store"]
    assert cli.complete("eaglepipe stage=tu", hydra) == ["stage=tune-serve"]
    found = cli.complete("eaglepipe verify ", hydra)
    assert asked[-1] == "eaglepipe  " and "verify" not in found  # the command word is no override
    assert "target=base_target" not in found and "+experiment=demo" in found and "target=tiny" in found


BASH = """
eval "$(eaglepipe -sc install=bash)"
ask() {
  COMP_LINE="$1"; COMP_POINT=${#1}; read -ra COMP_WORDS <<< "$1"
  [[ "$1" == *" " ]] && COMP_WORDS+=("")
  COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMPREPLY=()
  hydra_bash_completion; echo "${COMPREPLY[*]}"
}
ask "eaglepipe ver"
ask "eaglepipe check"
ask "eaglepipe verify export_d"
ask "eaglepipe train train.l"
ask "eaglepipe stage=tu"
ask "eaglepipe prepare target=ti"
"""


def test_bash_completes_commands_stage_values_groups_and_keys():
    """Hydra's own install script, sourced in bash, asking `eaglepipe -sc query=bash` as a user's TAB does."""
    r = subprocess.run(
        ["bash", "-c", BASH],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "verify",
        "check-store",
        "export_dir=",
        "train.log_every_steps= train.loss= train.loss_chunk_tokens= train.lr=",
        "stage=tune-serve",
        "target=tiny",
    ], r.stdout + r.stderr
