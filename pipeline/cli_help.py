"""The help pages of `eaglepipe`: `eaglepipe --help` (also -h, `help`) and `eaglepipe COMMAND --help`.

One page per command of pipeline/commands.py (tests/unit/test_cli_help.py fails when a command has none).
A page names what the command is for, what it writes, the settings it reads with their defaults (read from
the composed config, so a default shown is the default run), one example and its exit codes. Hydra's own page
stays at `--hydra-help`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.commands import ORDER, TOOLS, spelt

CONF = Path(__file__).resolve().parent.parent / "conf"
EXITS = (
    "exit codes: 0 done; 2 a mistake you can fix (one line `eaglepipe: error: ...`); 1 a bug (a traceback)"
)


@dataclass(frozen=True)
class Page:
    brief: str  # the main page's few words
    what: str  # one line: what it is for
    writes: str  # where its output goes
    reads: tuple[str, ...]  # settings: a dotted key, or `section.` for every key of a section
    example: str
    exits: str = EXITS
    more: str = ""  # a paragraph more, when one line is not enough


_RUN = ("run_dir", "cache_dir")
PAGES = {
    "prepare": Page(
        "conversations -> token ids + loss mask",
        "conversations -> chat-templated token ids with an assistant-only loss mask (answers regenerated "
        "by the target when asked)",
        "run_dir/prepared/ (a datasets folder and stats.json)",
        ("target", "data", *_RUN, "data.", "prepare."),
        "eaglepipe prepare target=tiny data=sharegpt data.path=sg.json data.limit=100 run_dir=runs/x",
    ),
    "extract": Page(
        "the target's aux + last hidden states",
        "the target's aux-layer and last hidden states of every prepared sample (docs/conventions.md: which "
        "layers)",
        "run_dir/features/ (zarr shards with crc32c checksums, manifest.json)",
        ("target", *_RUN, "extract."),
        "eaglepipe extract target=tiny run_dir=runs/x extract.aux_layers=[1,3,4]",
    ),
    "vocab": Page(
        "the draft vocabulary (d2t/t2d) + coverage",
        "the draft vocabulary (d2t/t2d) from the supervised tokens of the store, and its coverage report",
        "run_dir/vocab/ (d2t.npy, t2d.npy, manifest.json, report.json)",
        ("run_dir", "vocab."),
        "eaglepipe vocab run_dir=runs/x vocab.draft_vocab_size=8192",
    ),
    "train": Page(
        "the EAGLE-3 draft, resumable checkpoints",
        "the EAGLE-3 draft (speculators' model, our loop under accelerate); resumes from its last checkpoint",
        "run_dir/train/ (step_NNNNNN/ checkpoints, final/, train_summary.json, plots/curves.png)",
        ("run_dir", "seed", "train."),
        "eaglepipe train run_dir=runs/x train.lr=3e-4 train.max_steps=2000",
        more="several GPUs: accelerate launch --config_file conf/accelerate/ddp.yaml -m pipeline stage=train "
        "(docs/scale.md)",
    ),
    "export": Page(
        "SGLang + vLLM checkpoints, verified, serve.sh",
        "serving checkpoints in SGLang's and vLLM's own layouts, each loaded by the engine's own class to "
        "verify it",
        "run_dir/export/<engine>/ (model.safetensors, config.json, export_manifest.json, serve.sh)",
        ("run_dir", "export."),
        "eaglepipe export run_dir=runs/x export.engines=[sglang]",
    ),
    "evaluate": Page(
        "tau per draft length (offline) or speedup (online)",
        "accepted tokens per target forward (tau) per draft length, offline with the local target; with "
        "eval.endpoint, a running server's accept length and speedup",
        "run_dir/eval/ (acceptance.json and tau.png; online: online.json and online.png; "
        "eval/<set>/ per prompt set)",
        ("run_dir", "eval."),
        "eaglepipe evaluate run_dir=runs/x eval.num_prompts=32 eval.max_draft=5",
    ),
    "all": Page(
        "every stage in order, those up to date skipped",
        "every stage in order, prepare -> extract -> vocab -> train -> export -> evaluate; a stage whose "
        "inputs and settings did not change is skipped (run_dir/stages.json)",
        "every stage's folder, then run_dir/summary.md (the table, the pictures)",
        ("target", "data", "run_name", "run_dir", "cache_dir", "seed"),
        "eaglepipe all +experiment=demo   (what `make demo` runs)",
        more="each stage's settings: eaglepipe STAGE --help; the whole config: eaglepipe all --cfg job",
    ),
    "submit": Page(
        "the stages not up to date as a chain of SLURM jobs",
        "the stages not up to date, as a chain of SLURM jobs (each waits for the one before it)",
        "SLURM jobs; each stage writes its folder of run_dir as `all` would",
        ("run_dir", "submit."),
        "eaglepipe submit +experiment=gpu_smollm2 run_dir=/scratch/x submit.partition=gpu submit.wait=true",
        more="takes every override of `all` too (docs/scale.md)",
    ),
    "verify": Page(
        "will SGLang / vLLM load an export completely?",
        "will the engine load this export completely? Loads it into SGLang's / vLLM's own model class and "
        "loader on CPU (.venv-engines: make setup-engines)",
        "nothing (the report goes to the terminal)",
        ("export_dir", "engine", "run_dir", "export.engines", "export.verify_memo", "export.sglang_python"),
        "eaglepipe verify export_dir=runs/x/export/sglang",
        exits="exit codes: 0 every export loads completely; 2 an export fails (its problems printed first) "
        "or a mistake; 1 a bug",
    ),
    "serve": Page(
        "print an export's launch command",
        "print each export's launch command (its serve.sh, the line export verified)",
        "nothing (the command goes to the terminal)",
        ("engine", "export_dir", "run_dir", "export.engines"),
        "eaglepipe serve run_dir=runs/x engine=sglang",
    ),
    "doctor": Page(
        "an export against a server launch line or a running server",
        "an export against the server launch line (or running SGLang server) meant to serve it: EAGLE "
        "instead of EAGLE3, another draft path or target, the other engine's layout, missing aux ids",
        "nothing (one line per problem, each with its fix)",
        ("export_dir", "launch_file", "launch", "server"),
        "eaglepipe doctor export_dir=runs/x/export/sglang launch_file=runs/x/export/sglang/serve.sh",
        exits="exit codes: 0 the line serves this export; 2 problems found (listed first) or a mistake; "
        "1 a bug",
        more="launch_file=- reads the line from standard input (`< serve.sh`): no quoting, whatever the "
        "line holds; launch='...' must escape every ' inside it for Hydra",
    ),
    "parity": Page(
        "hf vs sglang capture of the same samples (GPU)",
        "the same samples captured by both backends (hf and sglang), compared layer by layer (GPU box with "
        "SGLang)",
        "run_dir/parity/ (two small stores and parity.json)",
        ("run_dir", "extract.limit"),
        "eaglepipe parity run_dir=runs/x extract.limit=64",
    ),
    "check_store": Page(
        "every chunk of the feature store against its crc32c",
        "read every chunk of the feature store and check its crc32c",
        "nothing (each damaged, cut or missing chunk, by shard)",
        ("run_dir",),
        "eaglepipe check-store run_dir=runs/x",
        exits="exit codes: 0 every chunk verifies; 2 damage found (repair: eaglepipe extract "
        "extract.repair=true) or a mistake; 1 a bug",
    ),
    "plan": Page(
        "training memory per GPU, from the config alone",
        "the draft's training memory per GPU for target x pack x TTT x ranks x DDP|FSDP, from the config "
        "alone (no weights, no GPU)",
        "nothing (a table per part, the peak, whether it fits)",
        (
            "target",
            "plan.",
            "train.tokens_per_pack",
            "train.ttt_steps",
            "train.strategy",
            "vocab.draft_vocab_size",
        ),
        "eaglepipe plan target=kimi_k25 train.tokens_per_pack=8192 train.ttt_steps=7 plan.world_size=8",
    ),
    "tune_serve": Page(
        "SGLang's speculative settings chosen by measurement",
        "the export's speculative settings (steps, top-k, draft tokens) chosen by measuring this machine's "
        "own SGLang server against a plain one (docs/serving.md)",
        "run_dir/tune/serve_sweep.json; rewrites export/sglang/serve.sh and its manifest's `serve`",
        ("run_dir", "export_dir", "tune.", "eval.concurrency", "eval.repeats", "eval.max_new_tokens"),
        "eaglepipe tune-serve run_dir=runs/x tune.grid.num_steps=[1,2,3] eval.concurrency=[1,8]",
    ),
}


def group_options(group: str) -> list[str]:
    """The files of conf/<group>/ a `group=` override picks from."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def main_page() -> str:
    stages = [f"  {n:<10} {PAGES[n].writes.split(' (')[0]:<26} {PAGES[n].brief}" for n in ORDER]
    tools = [f"  {spelt(n):<12} {PAGES[n].brief}" for n in [*TOOLS, "submit"]]
    return "\n".join(
        [
            "usage: eaglepipe COMMAND [key=value ...]      (no COMMAND: all)",
            "       eaglepipe COMMAND --help",
            "",
            "eaglepipe trains an EAGLE-3 speculative-decoding draft for a target LLM, exports it for SGLang",
            "and vLLM (verified in their own classes) and measures how many tokens it gets accepted.",
            "",
            "Stages, in order (`eaglepipe all` runs them, skipping those up to date), each writing a folder:",
            *stages,
            "",
            "Tools (never part of all):",
            *tools,
            "",
            "Start here (README.md):",
            "  make demo    set up, then every stage on SmolLM2-135M on CPU: eaglepipe all +experiment=demo",
            "  make test    the test suite, as CI runs it",
            "",
            "Settings are Hydra overrides, key=value (conf/config.yaml and its groups):",
            "  eaglepipe all run_dir=runs/x data.limit=200 train.lr=3e-4",
            f"  a group picks a file of conf/<group>/: target={'|'.join(group_options('target')[:4])}|...,"
            f" data={'|'.join(group_options('data')[:3])}|...",
            f"  an experiment adds a set of them: +experiment={'|'.join(group_options('experiment'))}",
            "  eaglepipe COMMAND --cfg job prints the config a command would run; -m sweeps (docs/scale.md)",
            '  tab completion in bash: eval "$(eaglepipe -sc install=bash)"',
            "",
            "Docs: README.md; docs/stages.md (stages, run dir, tools); docs/serving.md; docs/scale.md;",
            "      docs/conventions.md (layer ids, d2t); Hydra's own help: eaglepipe --hydra-help",
            EXITS,
        ]
    )


def command_page(name: str, cfg) -> str:
    """The page of one command; `cfg` is the default config composed for it (values shown as defaults)."""
    page = PAGES[name]
    head = f"eaglepipe {spelt(name)}: {page.what}"
    lines = [
        f"usage: eaglepipe {spelt(name)} [key=value ...]",
        "",
        *_wrap(head),
        *_wrap(f"writes: {page.writes}"),
        "",
        "settings it reads (key=default; override any as key=value):",
        *[f"  {line}" for key in page.reads for line in setting_lines(key, cfg)],
        "",
        "example:",
        f"  {page.example}",
        "",
        *([*_wrap(page.more), ""] if page.more else []),
        *_wrap(page.exits),
        "all commands: eaglepipe --help; docs: docs/stages.md",
    ]
    return "\n".join(lines)


def _wrap(text: str) -> list[str]:
    import textwrap

    return textwrap.wrap(text, 108, subsequent_indent="  ")


def setting_lines(key: str, cfg) -> list[str]:
    """`key=default` for one setting, each key of a section (`train.`), or a group's choice (`target`)."""
    from omegaconf import OmegaConf

    if (CONF / key).is_dir():  # a config group: the file chosen, and the others
        chosen = OmegaConf.select(cfg, f"hydra.runtime.choices.{key}", default="?")
        return [f"{key}={chosen}  ({', '.join(group_options(key))})"]
    if key.endswith("."):
        return [
            line for k in _leaf_keys(OmegaConf.select(cfg, key[:-1]), key) for line in setting_lines(k, cfg)
        ]
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if node is None or leaf not in node:
        raise KeyError(f"a help page names {key}, which is not a setting")
    return [f"{key}={shown(node, leaf)}"]


def _leaf_keys(node, prefix: str) -> list[str]:
    from omegaconf import DictConfig

    out = []
    for k in node.keys():
        child = node._get_node(k)
        if isinstance(child, DictConfig) and child._metadata.object_type is not dict:
            out += _leaf_keys(child, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


def shown(node, leaf: str) -> str:
    """A default as an override would write it: null, true, [a,b]; interpolations resolved where they can be
    (`???`: required, no default)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_missing(node, leaf):
        return "???  (required)"
    try:
        value = node[leaf]
        value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    except Exception:  # an interpolation only a run can resolve: shown as written
        value = node._get_node(leaf)._value()
    text = _override_text(value)
    return text if len(text) <= 70 else text[:67] + "..."


def _override_text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_override_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_override_text(v)}" for k, v in value.items()) + "}"
    return str(getattr(value, "value", value))


def command_help(name: str) -> str:
    """The page of `eaglepipe NAME --help`, its defaults from the config composed as the command composes it
    (with Hydra's choices, for the group lines; nothing written)."""
    from hydra import compose, initialize_config_dir

    from pipeline.config import register

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"stage={name}"], return_hydra_config=True)
    return command_page(name, cfg)
