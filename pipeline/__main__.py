"""`eaglepipe` / `python -m pipeline`: the only Hydra entry point; runs cfg.stage (or all stages in order).

`eaglepipe STAGE key=value ...` is shorthand for `eaglepipe stage=STAGE key=value ...`.

A user mistake is one line, `eaglepipe: error: ...`, and exit code 2: a UserError from a stage, and also what
fails before the first stage starts (Hydra's composition and override errors, a run_dir that is a file or
not writable); Hydra's own report of those is several lines and exit code 1."""

import logging
import os
import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline import ranks
from pipeline.config import register
from pipeline.config_limits import is_setting, unknown_key
from pipeline.errors import UserError

log = logging.getLogger("pipeline")
register()
CONF = Path(__file__).resolve().parent.parent / "conf"
_job = {"started": False}  # set once the task function runs: what fails after that is not a start-up error


@hydra.main(version_base="1.3", config_path=str(CONF), config_name="config")
def app(cfg: DictConfig) -> None:
    from pipeline.runner import run_stages

    _job["started"] = True
    if ranks.from_slurm() or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # in each task of an srun step too
        if os.environ.get("RANK", "0") == "0":
            log.info(ranks.describe())
    try:
        _sweep_job_run_dir(cfg)
        log.debug("resolved config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
        run_stages(cfg)
    except UserError as e:
        fail(str(e))
    except OmegaConfBaseException as e:
        if not hasattr(e, "full_key"):
            raise
        fail(f"the config does not resolve: {one_line(str(e))}")


def _sweep_job_run_dir(cfg: DictConfig) -> None:
    """In a multirun, job N's run dir is Hydra's job output dir, ${run_dir}/N (conf/hydra/default.yaml): sweep
    points never share checkpoints or stage records, and a requeued job (same N) resumes in its own. A run_dir
    given with an interpolation of the swept key (runs/lr + train.lr's value) already names each job: kept."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    given = [
        o.split("=", 1)[1]
        for o in HydraConfig.get().overrides.task
        if o.split("=", 1)[0].lstrip("+~") == "run_dir"
    ]
    if given and (
        "${" in given[-1] or "$\\{" in given[-1]
    ):  # names each job itself (run_dir=runs/lr${train.lr})
        log.info("multirun job %s: run_dir %s (as given)", HydraConfig.get().job.num, cfg.run_dir)
        return
    job_dir = HydraConfig.get().runtime.output_dir
    log.info(
        "multirun job %s (%s): run_dir %s",
        HydraConfig.get().job.num,
        HydraConfig.get().job.override_dirname or "no overrides",
        job_dir,
    )
    _refuse_a_job_with_nothing_to_start_from(cfg, job_dir, HydraConfig.get().job.num)
    cfg.run_dir = job_dir


def _refuse_a_job_with_nothing_to_start_from(cfg: DictConfig, job_dir: str, num) -> None:
    """A sweep of one later stage (`-m stage=train train.lr=a,b`) over a finished run: each job works in its
    own run dir, where no earlier stage ran; the one line says so, not "run stage=extract first" (which the
    user did, in the run dir above)."""
    from pipeline.runner import TOOLS

    stage = str(getattr(cfg.stage, "value", cfg.stage))
    # a job dir where earlier stages ran, or their outputs were copied in (docs/scale.md)
    started = ("stages.json", "prepared", "features", "vocab", "train", "export")
    if stage in ("all", "prepare", *TOOLS) or any((Path(job_dir) / p).exists() for p in started):
        return
    raise UserError(
        f"multirun job {num} runs stage={stage} in its own run dir {job_dir} (sweep points never share "
        f"checkpoints), where no earlier stage ran; a sweep does not read the stages finished in "
        f"{cfg.run_dir}: sweep stage=all (each job runs every stage in its own run dir)"
    )


def fail(message: str) -> None:
    print(f"eaglepipe: error: {message}", file=sys.stderr)
    sys.exit(2)


def one_line(text: str) -> str:
    """Hydra's and OmegaConf's multi-line reports as one line: the message lines joined, option lists
    comma-separated, the search path, key/type details and the HYDRA_FULL_ERROR hint left out."""
    noise = (
        "See https://hydra.cc",
        "Set the environment variable",
        "full_key:",
        "object_type=",
        "reference_type=",
        "provider=",
        "Config search path:",
    )
    parts: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(noise) or line.startswith("base_"):  # base_<group>: the schema
            continue
        if raw.startswith("\t") and parts:
            parts[-1] += ("" if parts[-1].endswith(":") else ",") + " " + line
        elif parts and parts[-1].endswith("."):
            parts[-1] += " " + line
        else:
            parts.append(line)
    return "; ".join(parts)


def startup_error(e: BaseException) -> str | None:
    """The one line for an error raised before the first stage started; None: not a user mistake."""
    from hydra.errors import ConfigCompositionException, OverrideParseException

    if isinstance(e, OverrideParseException):
        what = "; ".join(
            p for p in one_line(str(e)).split("; ") if not p.startswith("Error parsing override")
        )
        if e.override.startswith(("launch=", "+launch=")):  # a launch line's quotes, spaces or JSON
            return (
                f"override launch=...: {what}; a launch line holds characters Hydra's grammar reserves "
                "(' \" , [ ] { }): give doctor the file instead, launch_file=<serve.sh>, or read it from "
                "standard input: launch_file=- < serve.sh"
            )
        return (
            f"override {e.override!r}: {what}; Hydra's grammar reserves , [ ] {{ }} ( ) ' \" = "
            "and \\ in values: quote the value inside the override, e.g. \"data.path='/data/a,b.json'\""
        )
    if isinstance(e, ConfigCompositionException) and (m := re.match(r"Could not override '(.+?)'", str(e))):
        # Hydra's hint, "To append to your config use +key=...", adds a key nothing reads
        return unknown_key(m.group(1))
    if isinstance(e, (ConfigCompositionException, OmegaConfBaseException)):
        cause = e.__cause__
        text = one_line(str(e))
        if isinstance(cause, OmegaConfBaseException) and one_line(str(cause)) not in text:
            text += f"; {one_line(str(cause))}"
        return text
    if isinstance(e, (FileExistsError, NotADirectoryError)):
        return f"cannot create the run dir: {e.filename} is a file, not a directory; pick another run_dir"
    if isinstance(e, OSError):
        return f"cannot create the run dir {e.filename} ({e.strerror}); pick a writable run_dir"
    cause = e.__cause__
    if isinstance(e, ValueError) and "Unable to configure handler" in str(e) and isinstance(cause, OSError):
        return (
            f"cannot write the log file {cause.filename} ({cause.strerror}): the run dir must be a writable "
            "directory; fix its permissions or pick another run_dir"
        )
    return None


def schema_as_option(args: list[str]) -> str | None:
    """`target=base_target` (Hydra lists base_<group> among a group's options): the schema, not a config."""
    for arg in args:
        group, _, option = arg.lstrip("+~").partition("=")
        if option == f"base_{group}" and (CONF / group).is_dir():
            options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
            return (
                f"{group}={option} is the schema every {group}/*.yaml builds on, not a {group}: pick one "
                f"of {', '.join(options)}"
            )
    return None


def empty_run_dir(args: list[str]) -> str | None:
    """`run_dir=$UNSET`: Hydra would write .hydra/ and its log into the current directory before any check,
    and the stages after it."""
    for arg in args:
        key, _, value = arg.lstrip("+~").partition("=")
        if key == "run_dir" and not value.strip():
            return "run_dir is empty (an unset shell variable?): give it a directory"
    return None


def added_key(args: list[str]) -> str | None:
    """`+train.lrr=1e-9`: Hydra adds any key with `+` (its own hint for a misspelt one says to), nothing reads
    it, and Hydra writes the run dir's .hydra/ first. Config groups (`+experiment=tiny`) are not keys."""
    for arg in args:
        if arg.startswith("+") and not arg.startswith("++") and "=" in arg:
            key = arg[1:].split("=", 1)[0]
            if (
                not (CONF / key.split("/")[0]).is_dir()
                and not key.startswith("hydra")
                and not is_setting(key)
            ):
                return unknown_key(key)
    return None


# A tool (verify, serve, doctor, parity, check-store, plan) writes no Hydra files into a run directory: no
# .hydra/ config over the run's recorded one, no log file; its log goes to the terminal only (parity's own
# output goes to run_dir/parity/, no stage's folder).
TOOL_HYDRA = ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.run.dir=."]


def cpu_ranks_asked() -> int:
    """N of `accelerate launch --cpu --num_processes N`, read from that launcher's own command line (Linux
    /proc):
    with --cpu, accelerate takes its simple launcher, which starts ONE process whatever N says and passes no
    N on (it spawns N only for GPUs, or through mpirun). 1 when not launched so, or already one of several
    ranks."""
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() != "true" or "LOCAL_RANK" in os.environ:
        return 1
    try:
        args = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return 1
    return num_processes_of_launch(args)


def num_processes_of_launch(args: list[str]) -> int:
    """--num_processes of an accelerate launcher's command line: `accelerate launch`, `accelerate-launch` or
    `python -m accelerate.commands.launch` (what the GPU bench plans run); else 1."""
    if not any(
        a in ("launch", "accelerate.commands.launch") or Path(a).name == "accelerate-launch" for a in args
    ):
        return 1
    for i, a in enumerate(args):
        key, _, value = a.partition("=")
        if key in ("--num_processes", "--num-processes"):
            value = value or (args[i + 1] if i + 1 < len(args) else "1")
            return int(value) if value.isdigit() else 1
    return 1


LAUNCHER_PID = "EAGLEPIPE_LAUNCHER_PID"  # relaunch_ranks -> its ranks: the pid of the launcher they die with


def die_with_launcher() -> None:
    """SIGTERM to this process when the one that started it dies, however it dies (Linux prctl
    PR_SET_PDEATHSIG; issue #35 rule 2). A rank (LOCAL_RANK set: torchrun, accelerate launch): torchrun starts
    each rank in a session of its own, so a kill of the job's process group missed them and they trained on
    beside the rerun. This process before it becomes torchrun (relaunch_ranks): `accelerate launch` does not
    forward SIGTERM; dying with it, torchrun stops its ranks. A launcher already gone: stop now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = int(os.environ.pop(LAUNCHER_PID, 0) or os.getppid())
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def relaunch_ranks(argv: list[str]) -> None:
    """stage=train under `accelerate launch --cpu --num_processes N` (N > 1): this process becomes torchrun's
    launcher of the N ranks (gloo), so the command does what it says instead of training on one rank."""
    n = cpu_ranks_asked()
    if n > 1 and any(a in ("stage=train", "train") for a in argv):
        print(
            f"eaglepipe: accelerate launch --cpu starts one process; starting the {n} CPU ranks asked for "
            "through "
            "torch.distributed.run (gloo)",
            file=sys.stderr,
            flush=True,
        )
        die_with_launcher()  # kept across exec: torchrun dies with `accelerate launch`, and stops its ranks
        os.environ[LAUNCHER_PID] = str(os.getpid())  # torchrun's own pid: the parent each rank checks
        os.execv(
            sys.executable,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                "-m",
                "pipeline",
                *argv,
            ],
        )


def main() -> None:
    from pipeline import cli
    from pipeline.commands import TOOLS

    if "LOCAL_RANK" in os.environ:  # one rank of a job: it ends with its launcher
        die_with_launcher()
    relaunch_ranks(sys.argv[1:])
    if cli.is_completion_query(sys.argv[1:]):  # bash asks (eval "$(eaglepipe -sc install=bash)")
        print(" ".join(cli.complete(os.environ.get("COMP_LINE", ""), _hydra_completions)))
        return
    try:  # help pages, the command word, its spelling (check-store = check_store), options not Hydra's
        routed = cli.route(sys.argv[1:])
    except UserError as e:
        fail(str(e))
    if isinstance(routed, str):
        print(routed)
        return
    sys.argv[1:] = routed
    if any(a in {f"stage={t}" for t in [*TOOLS, "submit"]} for a in sys.argv[1:]):
        sys.argv += TOOL_HYDRA
    problem = schema_as_option(sys.argv[1:]) or empty_run_dir(sys.argv[1:]) or added_key(sys.argv[1:])
    if problem:
        fail(problem)
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra raises instead of printing several lines, exit 1
    try:
        app()
    except Exception as e:
        problem = None if _job["started"] else startup_error(e)
        if problem is None:
            raise
        fail(problem)


def _hydra_completions(line: str) -> list[str]:
    """Hydra's own bash completion of `line` (config groups, keys, group options), as a list."""
    import contextlib
    import io

    out, argv, comp_line = io.StringIO(), sys.argv, os.environ.get("COMP_LINE")
    os.environ["COMP_LINE"], sys.argv = line, [sys.argv[0], "-sc", "query=bash"]
    try:
        with contextlib.redirect_stdout(out):
            app()
    finally:
        sys.argv = argv
        os.environ.pop("COMP_LINE") if comp_line is None else os.environ.update(COMP_LINE=comp_line)
    return out.getvalue().split()


if __name__ == "__main__":
    main()
