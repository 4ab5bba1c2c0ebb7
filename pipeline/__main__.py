"""`eaglepipe` / `python -m pipeline`: the only Hydra entry point; runs cfg.stage (or all stages in order).

`eaglepipe STAGE key=value ...` is shorthand for `eaglepipe stage=STAGE key=value ...`."""

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeline.config import register
from pipeline.errors import UserError

log = logging.getLogger("pipeline")
register()


@hydra.main(version_base="1.3", config_path=str(Path(__file__).resolve().parent.parent / "conf"), config_name="config")
def app(cfg: DictConfig) -> None:
    from pipeline.stages import run_stages

    log.debug("resolved config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
    try:
        run_stages(cfg)
    except UserError as e:
        print(f"eaglepipe: error: {e}", file=sys.stderr)
        sys.exit(2)


# A tool (verify, serve, doctor, parity, check-store) reads a run directory but never writes into one: no
# .hydra/ config over the run's recorded one, no log file; its log goes to the terminal only.
TOOL_HYDRA = ["hydra.output_subdir=null", "hydra/job_logging=stdout", "hydra.run.dir=."]


def main() -> None:
    from pipeline.stages import TOOLS

    # `eaglepipe verify export_dir=...` is `eaglepipe stage=verify export_dir=...`
    if len(sys.argv) > 1 and "=" not in sys.argv[1] and not sys.argv[1].startswith("-"):
        sys.argv[1] = f"stage={sys.argv[1].replace('-', '_')}"  # check-store is stage=check_store
    if any(a in {f"stage={t}" for t in TOOLS} for a in sys.argv[1:]):
        sys.argv += TOOL_HYDRA
    app()


if __name__ == "__main__":
    main()
