"""Typed config schemas, registered with Hydra's ConfigStore. No logic here.

Each YAML group file under conf/ starts with `defaults: [base_<group>]`, so a typo or a wrong type fails
when the config is composed, before any stage runs.
"""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from pipeline.config_choices import (
    Backend,
    Compressor,
    DataFormat,
    DraftArch,
    FeatureSource,
    OnError,
    OnFailedRequest,
    OnLeak,
    OptimizerChoice,
    Resume,
    Select,
    ServerEngine,
    Stage,
    StoreDtype,
    StoreWriter,
    Strategy,
    TargetSource,
    WandbMode,
)
from pipeline.config_tools import PlanConfig, SubmitConfig, TuneConfig


@dataclass
class TargetConfig:
    name: str = MISSING
    source: TargetSource = TargetSource.path
    # source=path: the HF folder; source=smollm2_gguf: the .gguf (null = the wheel's);
    # source=qwen25_coder_gguf: the joined .gguf or a folder of its part files (null = the installed wheels')
    path: str | None = None
    # Expected shape: checked against the loaded config.json, so a wrong `path` fails loudly.
    num_layers: int = MISSING
    hidden_size: int = MISSING
    vocab_size: int = MISSING
    trust_remote_code: bool = False
    # Declared layer shape, used only to build the draft without the checkpoint (meta-device sizing);
    # with a real folder the draft always takes these from its config.json.
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    # Declared total parameter count (every expert of a MoE), for `eaglepipe plan`'s rows of the target's own
    # weights (train.features=online, train.eval_tau_every_steps); null = a dense estimate from the shape
    # above
    num_parameters: int | None = None


@dataclass
class SourceConfig:  # one entry of data.sources (data=mix)
    format: DataFormat = MISSING  # chitchat | chatterbot | sharegpt | messages | hf (not mix)
    name: str | None = (
        None  # the label in counts and source ids; null = format (two of one format need names)
    )
    path: str | None = None  # chitchat/chatterbot/sharegpt: null = the PyPI wheel's data
    limit: int | None = (
        None  # training conversations taken from this source (after dedup and held-out); null = all
    )
    weight: float | None = None  # this source's share of data.limit (set on every source or none)
    heldout: int = 0  # conversations of this source set aside for validation/evaluation, never trained on


@dataclass
class DataConfig:
    name: str = MISSING
    format: DataFormat = MISSING
    path: str | None = None  # chitchat: None = the dataset inside the PyPI wheel
    split: str = "train"  # HF split syntax: train, train[:90%], train[100:200]
    limit: int | None = None  # conversations after shuffling; null = all
    seed: int = 0
    shuffle: bool = True
    on_error: OnError = OnError.skip
    # embedded sources (chitchat, chatterbot) whose conversations join this one's before the shuffle and the
    # limit, e.g. data=chitchat data.extra_sources=[chatterbot] data.limit=null: every usable chat of both
    # wheels
    extra_sources: list[str] = field(default_factory=list)
    sources: list[SourceConfig] = field(default_factory=list)  # data=mix only (conf/data/mix.yaml)
    on_leak: OnLeak = (
        OnLeak.fail
    )  # a user turn that is (nearly) an MT-bench or HumanEval prompt: fail | drop | allow


@dataclass
class RegenerateServerConfig:
    engine: ServerEngine = ServerEngine.none
    python: str | None = None  # the interpreter that runs the engine; null = this one (sys.executable)
    env: dict[str, str] = field(default_factory=dict)  # added to the environment, e.g. {PYTHONPATH: ...}
    args: list[str] = field(default_factory=list)  # appended to the launch line, e.g. [--tp-size, "8"]
    # engine=command: the whole launch line; {model}, {host} and {port} are filled in
    command: list[str] | None = None
    host: str = "127.0.0.1"
    port: int | None = None  # null = a free port
    startup_timeout_s: float = 900.0  # weights load + CUDA graphs: minutes for a large target
    mem_fraction: float | None = (
        None  # sglang --mem-fraction-static / vllm --gpu-memory-utilization; null = theirs
    )


@dataclass
class PrepareConfig:
    max_len: int = 2048
    # Cut conversations after this many assistant turns (null = keep all); text past max_len is never trained
    # on.
    max_assistant_turns: int | None = None
    regenerate: bool = False
    regenerate_endpoint: str | None = None  # OpenAI-compatible base URL, e.g. http://localhost:30000
    regenerate_model: str | None = None  # model name sent to the endpoint; null = the target's name
    # a server eaglepipe starts for the target (and stops), whose URL becomes the endpoint
    regenerate_server: RegenerateServerConfig = field(default_factory=RegenerateServerConfig)
    max_new_tokens: int = 256
    temperature: float = 0.0
    # Kept answers (docs/answers.md): files of the target's temperature-0 answers reused before any is
    # regenerated, each checked against this run's target, tokenizer, template and decoding settings (a file
    # that does not match is named in the log, never used). null = every data/answers/*.jsonl.xz of this
    # repository; [] = none
    answers: list[str] | None = None
    gen_batch_size: int = 16
    # conversations in flight at the endpoint, each advancing through its own turns (a server batches them)
    endpoint_concurrency: int = 256
    endpoint_timeout_s: float = 120.0
    endpoint_retries: int = (
        4  # a failed request (transport, HTTP 5xx/429, empty or non-OpenAI answer) is asked again
    )
    endpoint_backoff_s: float = 1.0  # before retry k: endpoint_backoff_s * 2^(k-1) seconds
    on_failed_request: OnFailedRequest = OnFailedRequest.fail
    # Magpie-style prompts: the target writes this many user turns itself (from its template's user prefix),
    # filtered (length, duplicates, refusals/role leaks, non-English), then answered like the rest
    synthesize: int = 0
    synthesize_system: str | None = (
        None  # a system prompt rendered before the user prefix; null = the template's
    )
    synthesize_max_new_tokens: int = 256
    synthesize_temperature: float = 1.0
    synthesize_min_chars: int = 16
    synthesize_max_chars: int = 4000


@dataclass
class ExtractConfig:
    backend: Backend = Backend.hf
    # 0-based decoder layer ids; id k = residual stream after layer k. null = [1, L//2-1, L-4].
    aux_layers: list[int] | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto = bf16 on GPU, fp32 on CPU
    attn_implementation: str = "sdpa"
    # backend=sglang: SGLang's attention backend (null = SGLang's choice: fa3 on Hopper; "triton" where FA3
    # is not installed, like the H200 bundle's 0.5.17)
    sglang_attention_backend: str | None = None
    sglang_mem_fraction: float = 0.8  # backend=sglang: SGLang's mem_fraction_static (weights + KV pool)
    # padded tokens per forward (length-bucketed); larger = faster on GPU, more memory; CPU wants ~4096
    batch_tokens: int = 16384
    max_batch_size: int = 64
    # A shard closes when the next sample would exceed this: the host buffer per shard (x 2: one commits while
    # the next computes), 1.2 GB for SmolLM2, 15 GB for Kimi-K2.5.
    shard_tokens: int = 262144
    # > 1: processes that encode and write every shard's chunks from shared memory (/dev/shm: 2 shards per
    # rank of the node); 1: this process (docs/feature_store.md, writing protocol 5). Raise it where the
    # writer, not the capture, binds (scripts/bench/capture.py measures both). Not in extract's fingerprint:
    # the bytes are the same
    write_workers: int = 1
    # tensorstore: Google's C++ zarr v3 writer encodes and writes every array of a shard on all cores, outside
    # the GIL (chunks byte for byte those zarr-python writes: same codecs, crc32c last); zarr: zarr-python in
    # this process (or write_workers processes). scripts/bench/shard_commit.py --writers measures both. Not in
    # extract's fingerprint
    writer: StoreWriter = StoreWriter.tensorstore
    # zarr chunk length along tokens of the 2-D arrays (the 1-D input_ids / loss_mask: at least 16,384 tokens,
    # feature_store.ID_CHUNK_TOKENS). A loader reading a ~450-token sample decodes every chunk it touches: 512
    # reads 1.6x faster per worker than 2048 for +0.05% bytes and 4x the chunk files (docs/feature_store.md,
    # "Chunk length"); raise it where the filesystem dislikes many small files. Not in extract's fingerprint
    chunk_tokens: int = 512
    # bitshuffled lz4: on SmolLM2's bf16 states (H200) 1.5% smaller AND 10% faster end to end than zstd level
    # 3 (docs/feature_store.md "Compressor"); `none` for the fastest writes (+21% bytes). Not in extract's
    # fingerprint.
    compressor: Compressor = Compressor.blosc_lz4
    store_dtype: StoreDtype = (
        StoreDtype.bf16
    )  # fp8_e4m3: a different store (its facts say so), decoded to bf16
    clevel: int = 3
    limit: int | None = None  # first N prepared samples; null = all
    overwrite: bool = False  # allow replacing features made from other inputs
    repair: bool = False  # check every chunk first; shards with a damaged chunk are extracted again


@dataclass
class VocabConfig:
    draft_vocab_size: int = 32000  # Kimi-K2.5: 32K of 163,840. Fewer ids seen than this -> padded (warned)


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.offline  # online with a WANDB_API_KEY; disabled on hosts without wandb
    project: str = "eaglepipe"
    name: str | None = None  # null = run_name


@dataclass
class TrainConfig:
    draft_arch: DraftArch = (
        DraftArch.llama
    )  # mla: an MLA target's (Kimi-K2.x, DeepSeek-V3) latent-cache draft
    strategy: Strategy = Strategy.ddp  # on several ranks: ddp | fsdp (needs >= 2 ranks)
    features: FeatureSource = FeatureSource.offline  # online: the target beside the draft, no feature store
    # tau of the draft as exported, every N optimizer steps and at the last (rank 0; eval.num_prompts held-out
    # prompts, k = 1..eval.max_draft, the fp32 target on eval.device): metrics.jsonl split "tau", wandb
    # tau/k=K
    eval_tau_every_steps: int | None = None
    select: Select = Select.last  # tau: export the step of the highest tau at k = export.serve.num_steps
    ttt_steps: int = 3  # test-time-training unroll: draft positions trained per token
    ttt_step_loss_decay: float = 1.0
    loss: str = "kl_div"  # speculators loss spec (eager implementation)
    # kl_div over chunks of this many positions, keeping only the logits for the backward
    # (pipeline/models/losses.py:
    # the same loss and gradients to 1e-6, without 2 fp32 [T, draft vocab] softmaxes per TTT step); null =
    # eager
    loss_chunk_tokens: int | None = 2048
    # tokens per micro-batch (packed samples, no cross-sample attention); x grad_accum x ranks = tokens per
    # step
    tokens_per_pack: int = 4096
    # a sample longer than a pack is split into windows of tokens_per_pack; each later window repeats this
    # many positions before it as context (attended to, not scored). null = tokens_per_pack // 4
    split_context: int | None = None
    # pad every pack to exactly tokens_per_pack (document id -1, loss mask 0): one shape for every step, so a
    # compiled step compiles once (issue #14); the loss and its gradients are those of the unpadded pack.
    # null = on when training on CUDA, where speculators compiles the forward: with one shape it stays
    # compiled (99.8K tokens/s on the H200, BENCHMARKS.md 2026-12-02); with a length per pack dynamo hits its
    # recompile limit and runs eager. Off on CPU (no compilation: the padding would only cost)
    pad_packs: bool | None = None
    grad_accum: int = 1
    epochs: int = 1
    max_steps: int | None = None  # null = epochs x packs / grad_accum
    lr: float = 3e-4
    weight_decay: float = 0.0
    # AdamW's (beta1, beta2): torch's, as speculators' Trainer uses. With EAGLE's 0.95 (the default until
    # 2026-12-02) val acc_0 was 1.6 points below speculators' on the same packs and steps; with 0.999 it is
    # equal (BENCHMARKS.md, "our loop with speculators' AdamW betas")
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # adamw | muon (speculators 0.9's choice): Muon on the draft's 2D weight matrices (muon_*), AdamW (lr,
    # adam_betas, weight_decay) on the rest; one LR schedule scales both
    optimizer: OptimizerChoice = OptimizerChoice.adamw
    # null = train.lr (speculators' CLI does the same: with match_rms_adamw Muon's update has AdamW's RMS)
    muon_lr: float | None = None
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    schedule: str = "cosine"  # transformers get_scheduler name: cosine | linear | constant_with_warmup
    warmup_steps: int = 10
    max_grad_norm: float = 1.0
    val_fraction: float = 0.05  # held out by sample
    val_every_steps: int = 50
    log_every_steps: int = 5
    save_every_steps: int = 100
    keep_last: int = 2
    resume: Resume = Resume.auto  # a typo fails at composition, never falls through to the deleting `never`
    num_workers: int = 1  # DataLoader prefetch workers
    device: str = "auto"
    attn_implementation: str = "sdpa"  # FlexAttention has no CPU backward: sdpa/eager on CPU
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ServeConfig:
    # written into serve.sh (and the manifest's `serve`); `eaglepipe tune-serve` measures them per deployment
    num_steps: int = 3  # --speculative-num-steps (draft chain length)
    topk: int = 1  # --speculative-eagle-topk
    num_draft_tokens: int = 4  # --speculative-num-draft-tokens
    # Extra server flags appended to serve.sh as written, e.g. [--attention-backend, triton] (an SGLang
    # without FA3, like the H200 bundle's 0.5.17) or [--mem-fraction-static, "0.5"]
    sglang_args: list[str] = field(default_factory=list)
    vllm_args: list[str] = field(default_factory=list)


@dataclass
class ExportConfig:
    engines: list[str] = field(default_factory=lambda: ["sglang", "vllm"])
    serve: ServeConfig = field(default_factory=ServeConfig)
    # Load each export into the engine's own class (.venv-engines: make setup-engines).
    verify_in_engine: bool = True
    # the engine's report of the same export bytes in the same engine (and checking code) is remembered in
    # cache_dir/engine_reports/ and not loaded again (pipeline/formats/engine_memo.py); false: load every time
    verify_memo: bool = True
    sglang_python: str | None = None  # null = <repo>/.venv-engines/bin/python
    vllm_python: str | None = None  # null = <repo>/.venv-engines/bin/python


@dataclass
class EvalConfig:
    # prompt sets: heldout (validation samples, cut where the assistant starts answering), mt_bench (first
    # turn), mt_bench_turn2 (second turn, after the target's greedy first answer), humaneval
    # (pipeline/data/prompt_sets.py: data files of PyPI wheels); heldout -> eval/, another set -> eval/<set>/
    sets: list[str] = field(default_factory=lambda: ["heldout"])
    num_prompts: int = 8  # per set
    prompt_tokens: int = 384  # longest prompt used (a second-turn prompt: + first_answer_tokens)
    first_answer_tokens: int = (
        256  # mt_bench_turn2: the target's greedy first answer, cut at this many tokens
    )
    max_new_tokens: int = 32
    max_draft: int = 5  # draft lengths 1..max_draft
    device: str = "auto"  # the target and the draft run in fp32 here, on this device
    # prompts decoded together by the offline bench (pipeline/acceptance/batched.py), each once per draft
    # length in the same pass: batch_size x max_draft rows of KV cache (fp32) at once; 1 = one at a time
    # through the serial reference (offline.speculate, transformers' generate). Results are the same either
    # way.
    batch_size: int = 16
    # Online bench instead of the offline one: a running SGLang/vLLM server serving this draft
    endpoint: str | None = None  # e.g. http://localhost:30000
    baseline_endpoint: str | None = None  # the same target without speculation, for the speedup
    # the firm bench (docs/serving.md): per concurrency, `repeats` passes over every prompt, the two servers'
    # passes interleaved; median and spread of tokens/s and of the speedup. e.g. [1, 8, 32]
    concurrency: list[int] = field(default_factory=lambda: [1])
    repeats: int = 3
    warmup_prompts: int = 4  # requests sent to each server first, not counted (JIT, first-request costs)
    endpoint_timeout_s: float = 300.0


@dataclass
class Config:
    stage: Stage = Stage.all
    run_name: str = "default"
    run_dir: str = MISSING
    cache_dir: str = MISSING
    seed: int = 0
    target: TargetConfig = MISSING
    data: DataConfig = MISSING
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    submit: SubmitConfig = field(default_factory=SubmitConfig)
    # the tools (verify, serve, doctor)
    export_dir: str | None = None  # an export folder; null = run_dir/export/<engine>
    engine: str | None = None  # sglang | vllm; null = the export's own (verify) or every exported engine
    launch: str | None = None  # doctor: the server launch line
    # doctor: a file holding the launch line (serve.sh), `-` = standard input: no quoting for Hydra needed
    launch_file: str | None = None
    server: str | None = None  # doctor: a running SGLang server's URL (read from its /server_info)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="target", name="base_target", node=TargetConfig)
    cs.store(group="data", name="base_data", node=DataConfig)
    cs.store(group="prepare", name="base_prepare", node=PrepareConfig)
    cs.store(group="extract", name="base_extract", node=ExtractConfig)
    cs.store(group="vocab", name="base_vocab", node=VocabConfig)
    cs.store(group="train", name="base_train", node=TrainConfig)
    cs.store(group="export", name="base_export", node=ExportConfig)
    cs.store(group="eval", name="base_eval", node=EvalConfig)
