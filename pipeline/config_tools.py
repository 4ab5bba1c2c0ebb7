"""The tools' config schemas (plan, tune-serve, submit): part of Config (pipeline/config.py), kept apart so
each file stays small. No logic here."""

from dataclasses import dataclass, field


@dataclass
class PlanConfig:  # `eaglepipe plan` (pipeline/tools/plan.py); the shape comes from target, train, vocab
    world_size: int = 8  # ranks; DDP or FSDP is train.strategy
    gpu_memory_gib: float = 139.0  # an H200's usable memory
    precision: str = "bf16"  # bf16 (autocast on GPU, as train runs there) | fp32 (CPU)


@dataclass
class TuneGrid:  # the candidates of `eaglepipe tune-serve`: every combination of these lists
    num_steps: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])  # --speculative-num-steps
    topk: list[int] = field(default_factory=lambda: [1])  # --speculative-eagle-topk
    # --speculative-num-draft-tokens; null = num_steps + 1 (what SGLang runs at topk 1 whatever is asked)
    num_draft_tokens: list[int | None] = field(default_factory=lambda: [None])
    attention_backend: list[str | None] = field(default_factory=lambda: [None])  # null = serve.sh's own
    cuda_graph_max_bs: list[int | None] = field(default_factory=lambda: [None])  # null = serve.sh's own


@dataclass
# `eaglepipe tune-serve` (pipeline/tools/tune_serve.py, docs/serving.md); the bench is eval.*
class TuneConfig:
    grid: TuneGrid = field(default_factory=TuneGrid)
    objective_concurrency: int = 1  # the winner: the highest median tokens/s at this one of eval.concurrency
    # a running plain server of the same target; null = started once from serve.sh without the speculative
    # flags
    baseline_endpoint: str | None = None
    # what the launch lines start with instead of serve.sh's `python -m sglang.launch_server`, e.g. another
    # Python's path (`/opt/sglang/bin/python -m sglang.launch_server`) or tests' SGLang-like test server
    # script
    launch_prefix: str | None = None
    # flags for the sweep's servers only, never written to serve.sh, e.g. [--mem-fraction-static, "0.35"] so
    # the baseline and a candidate fit on one GPU together
    server_args: list[str] = field(default_factory=list)
    start_timeout_s: float = (
        900.0  # a server not healthy by then failed (SGLang with graphs: ~2 min on the H200)
    )


@dataclass
class StageMinutes:  # each stage's SLURM time limit (--time), in minutes
    prepare: int = 240
    extract: int = 1440
    vocab: int = 60
    train: int = 2880
    export: int = 60
    evaluate: int = 240


@dataclass
class SubmitConfig:  # `eaglepipe submit` (pipeline/cluster/chain.py, docs/scale.md): the chain as SLURM jobs
    partition: str | None = None  # null = the cluster's default partition
    account: str | None = None
    qos: str | None = None
    ranks: int = 8  # tasks of the extract and train jobs (srun starts them); every other stage runs one
    gpus_per_rank: int = 1
    cpus_per_rank: int = 8
    mem_gb_per_rank: int = 64
    time_min: StageMinutes = field(default_factory=StageMinutes)
    signal_delay_s: int = (
        180  # SIGUSR2 this long before a job's time limit: training checkpoints and requeues
    )
    wait: bool = False  # follow the chain until it ends, a line per change of a job's state
    poll_s: float = 5.0
