"""pipeline/__main__.py: what fails before the first stage starts is one line (#12 B16, B17, B22, Hydra)."""

import errno

from hydra.errors import MissingConfigException, OverrideParseException

from pipeline.__main__ import one_line, schema_as_option, startup_error


def test_an_unwritable_log_file_is_named_with_the_fix():
    e = ValueError("Unable to configure handler 'file'")
    e.__cause__ = PermissionError(errno.EACCES, "Permission denied", "/runs/x/__main__.log")
    assert startup_error(e) == (
        "cannot write the log file /runs/x/__main__.log (Permission denied): the run dir "
        "must be a writable directory; fix its permissions or pick another run_dir"
    )


def test_a_run_dir_that_is_a_file_is_named():
    line = startup_error(FileExistsError(errno.EEXIST, "File exists", "/runs/x"))
    assert line == "cannot create the run dir: /runs/x is a file, not a directory; pick another run_dir"


def test_a_read_only_file_system_is_named():
    line = startup_error(OSError(errno.EROFS, "Read-only file system", "/ro/x"))
    assert line == "cannot create the run dir /ro/x (Read-only file system); pick a writable run_dir"


def test_other_errors_are_not_startup_user_errors():
    assert startup_error(KeyError("x")) is None and startup_error(ValueError("Unable to parse")) is None


def test_hydra_reports_become_one_line_without_search_path_or_schema_options():
    e = MissingConfigException(
        "In 'config': Could not find 'target/nope'\n\nAvailable options in 'target':\n"
        "\tbase_target\n\tsmollm2\n\ttiny\nConfig search path:\n\tprovider=hydra, path=pkg://x\n"
    )
    assert (
        startup_error(e)
        == "In 'config': Could not find 'target/nope'; Available options in 'target': smollm2, tiny"
    )
    parse = OverrideParseException(
        "data.path=a 'b'",
        "Error parsing override 'data.path=a 'b''\nextraneous input\n"
        "See https://hydra.cc/docs/1.2/advanced/override_grammar/basic for details",
    )
    line = startup_error(parse)
    assert (
        line.startswith("override \"data.path=a 'b'\": extraneous input; Hydra's grammar reserves")
        and "\n" not in line
    )
    assert "data.path='/data/a,b.json'" in line


def test_a_launch_line_hydra_cannot_parse_points_to_launch_file():
    """`doctor launch="$(cat serve.sh)"` with a run dir whose path has a space: serve.sh quotes the path, so
    Hydra cannot parse the override; the hint is the file, which needs no quoting (not the form typed)."""
    for value in ("python -m sglang.launch_server --model-path '/r/my run/t'", "'$(cat serve.sh)'"):
        e = OverrideParseException(f"launch={value}", "Error parsing override\nmismatched input '/'")
        line = startup_error(e)
        assert "launch_file=<serve.sh>" in line and "launch_file=- < serve.sh" in line, line
        assert "$(cat" not in line and "\n" not in line


def test_one_line_joins_sentences_and_drops_key_details():
    assert (
        one_line("Could not override 'x'.\nTo append use +x=1\nKey 'x' not in 'Config'\n    full_key: x\n")
        == "Could not override 'x'. To append use +x=1; Key 'x' not in 'Config'"
    )


def test_a_schema_given_as_a_group_option_is_refused_with_the_real_options():
    line = schema_as_option(["stage=prepare", "target=base_target"])
    assert line.startswith(
        "target=base_target is the schema every target/*.yaml builds on, not a target: pick one of"
    )
    assert "smollm2" in line and "tiny" in line
    assert schema_as_option(["target=tiny", "run_dir=base_run"]) is None


def test_the_cpu_ranks_asked_are_read_from_every_form_of_accelerates_launcher():
    """`accelerate launch --cpu` starts one process whatever --num_processes says; eaglepipe reads N from its
    launcher's command line. `python -m accelerate.commands.launch` (the GPU plans' form) trained on 1
    rank."""
    from pipeline.__main__ import num_processes_of_launch

    for head in (
        ["/venv/bin/accelerate", "launch"],
        ["/venv/bin/accelerate-launch"],
        ["/venv/bin/python3", "-m", "accelerate.commands.launch"],
    ):
        assert num_processes_of_launch([*head, "--cpu", "--num_processes", "2", "-m", "pipeline"]) == 2
        assert num_processes_of_launch([*head, "--cpu", "--num_processes=4", "-m", "pipeline"]) == 4
    assert num_processes_of_launch(["/venv/bin/python3", "-m", "pipeline", "--num_processes", "2"]) == 1
