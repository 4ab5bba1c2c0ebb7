"""The help pages, run as a user types them (the installed `eaglepipe` script, a subprocess): the main page, a
page per command in either spelling, Hydra's own page kept at --hydra-help; every command has a page, and
README's first section shows the main page's first lines."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cli_help, commands
from pipeline.config_choices import Stage

ROOT = Path(__file__).resolve().parents[2]
EAGLEPIPE = Path(sys.executable).parent / "eaglepipe"  # the console script `make setup` installs


def eaglepipe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(EAGLEPIPE), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_every_command_has_a_help_page_and_is_a_stage_value():
    """A stage or tool added to pipeline/commands.py without a page fails here; the config's Stage enum is
    keyed on the same list."""
    assert sorted(cli_help.PAGES) == sorted(commands.NAMES)
    assert [s.value for s in Stage] == commands.NAMES


@pytest.mark.parametrize("form", [["--help"], ["-h"], ["help"]])
def test_the_main_page_names_every_stage_tool_and_where_to_start(form):
    r = eaglepipe(*form)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    page = r.stdout
    assert page.startswith("usage: eaglepipe COMMAND [key=value ...]")
    assert "powered by Hydra" not in page
    for stage, folder in zip(
        commands.ORDER, ["prepared/", "features/", "vocab/", "train/", "export/", "eval/"]
    ):
        line = next(x for x in page.splitlines() if x.startswith(f"  {stage} "))
        assert f"run_dir/{folder}" in line, line
    for tool in [*commands.TOOLS, "submit"]:
        assert f"\n  {commands.spelt(tool)} " in page
    assert "check_store" not in page and "tune_serve" not in page  # one spelling, the README's
    for needed in (
        "make demo",
        "make test",
        "+experiment=demo",
        "--cfg job",
        "docs/stages.md",
        "--hydra-help",
    ):
        assert needed in page, needed
    assert "-sc install=bash" in page and "exit codes: 0" in page and "--hydra-help" in page


def test_hydra_help_keeps_hydras_own_page():
    r = eaglepipe("--hydra-help")
    assert r.returncode == 0 and "Hydra" in r.stdout and "--shell-completion" in r.stdout


@pytest.mark.parametrize("name", commands.NAMES)
def test_each_command_has_its_page_with_settings_defaults_example_and_exit_codes(name):
    r = eaglepipe(commands.spelt(name), "--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    page = r.stdout
    assert page.startswith(f"usage: eaglepipe {commands.spelt(name)} [key=value ...]")
    assert f"eaglepipe {commands.spelt(name)}: {cli_help.PAGES[name].what[:40]}" in page
    assert "\nexample:\n  eaglepipe " in page and "exit codes: 0" in page
    for key in cli_help.PAGES[name].reads:  # every setting named, with its default
        if key.endswith("."):
            assert f"\n  {key}" in page, key
        else:
            assert f"\n  {key}=" in page, key


def test_a_page_shows_the_defaults_the_command_runs_with():
    """The defaults come from the composed config (conf/ files over the schema), not from a copy."""
    page = eaglepipe("train", "--help").stdout
    assert "\n  train.lr=0.0003\n" in page and "\n  train.adam_betas=[0.9,0.999]\n" in page
    assert "\n  run_dir=runs/smollm2-135m-instruct-chitchat\n" in page  # the interpolation resolved
    prepare = eaglepipe("prepare", "--help").stdout
    assert "\n  target=smollm2  (kimi_k25, " in prepare and "\n  data.split=train\n" in prepare
    doctor = eaglepipe("doctor", "--help").stdout
    assert "\n  launch_file=null\n" in doctor and "launch_file=- reads the line from standard input" in doctor


@pytest.mark.parametrize(
    "args",
    [
        ["check_store", "--help"],
        ["stage=check-store", "--help"],
        ["help", "check-store"],
        ["-h", "check-store"],
    ],
)
def test_either_spelling_and_every_form_of_asking_gives_the_same_page(args):
    r = eaglepipe(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: eaglepipe check-store [key=value ...]")


def test_a_page_naming_a_setting_the_config_lacks_fails(monkeypatch):
    monkeypatch.setitem(
        cli_help.PAGES, "serve", dataclasses.replace(cli_help.PAGES["serve"], reads=("engin",))
    )
    with pytest.raises(KeyError, match="engin, which is not a setting"):
        cli_help.command_help("serve")


def test_readme_first_section_shows_the_first_lines_of_eaglepipe_help():
    readme = (ROOT / "README.md").read_text()
    first_section = readme.split("\n## ", 1)[0]
    head = eaglepipe("--help").stdout.splitlines()[:14]
    assert "\n".join(head) in first_section, "README's first section: paste `eaglepipe --help | head -14`"


def test_docs_name_every_tool_in_its_one_spelling():
    doc = (ROOT / "docs" / "stages.md").read_text().split("## The map", 1)[0]
    for tool in commands.TOOLS:
        assert f"`{commands.spelt(tool)}`" in doc, tool
