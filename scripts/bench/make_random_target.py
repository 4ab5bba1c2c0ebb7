"""Benchmark helper: an HF folder holding a random-init Llama at a target's declared shape
(conf/target/NAME.yaml), saved in bf16 with another folder's tokenizer. No download: the 8B-shape capture
bench reads it (`target=llama3_8b target.path=FOLDER`); its states are noise, only speed and bytes count.
Usage:  python scripts/bench/make_random_target.py llama3_8b /tmp/l8b TOKENIZER_FOLDER
"""

import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]


def main(name: str, out: str, tokenizer_from: str) -> None:
    t = OmegaConf.load(ROOT / "conf" / "target" / f"{name}.yaml")
    keys = "vocab_size hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim"
    shape = {k: int(t[k]) for k in keys.split()} | {"num_hidden_layers": int(t.num_layers)}
    shape |= {"max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
    config = LlamaConfig(**shape, tie_word_embeddings=False, torch_dtype="bfloat16")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(out)
    n, dt = sum(p.numel() for p in model.parameters()) / 1e9, time.perf_counter() - t0
    print(f"{name}: random-init Llama, {n:.2f}B parameters, saved to {out} in {dt:.1f} s")


if __name__ == "__main__":
    main(*sys.argv[1:4])
