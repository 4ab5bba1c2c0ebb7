"""Each stage's check(cfg) refuses settings that used to run silently or crash late (issue #12), one line
naming every bad key, before the stage touches anything."""

import pytest

from pipeline.acceptance.prompts import heldout_prompts
from pipeline.errors import UserError
from pipeline.runner import preflight
from pipeline.stages import evaluate, export, extract, prepare, train, vocab


@pytest.mark.parametrize(
    "stage,overrides,message",
    [
        (train, ["train.max_steps=0"], r"train.max_steps=0 must be >= 1"),  # B10: trained every step
        (train, ["train.max_steps=-5"], r"train.max_steps=-5 must be >= 1"),  # blamed grad_accum
        (
            train,
            ["train.save_every_steps=0", "train.val_every_steps=0"],
            r"train.val_every_steps=0 must be >= 1; train.save_every_steps=0 must be >= 1",
        ),  # B8: ZeroDivisionError
        (train, ["train.lr=-1"], r"train.lr=-1.0 must be > 0"),  # B9: torch's ValueError
        (
            train,
            ["train.adam_betas=[0.9,1.5]"],
            r"train.adam_betas\[\]=1.5 must be in \[0, 1\)",
        ),
        (train, ["train.adam_betas=[0.9]"], r"train.adam_betas=\[0.9\] must be two values"),
        # a typo reached transformers' attention registry inside speculators' forward, after the store was
        # opened
        (
            train,
            ["train.attn_implementation=flex"],
            r"train.attn_implementation='flex' is not one of \['sdpa', 'eager', "
            r"'simple_flex_attention'\]",
        ),
        # FlexAttention on the CPU: NotImplementedError at the first backward, a traceback mid-stage
        (
            train,
            ["train.attn_implementation=simple_flex_attention", "train.device=cpu"],
            r"train.attn_implementation=simple_flex_attention needs a GPU \(FlexAttention has no CPU "
            r"backward\)",
        ),
        (evaluate, ["eval.max_draft=0"], r"eval.max_draft=0 must be >= 1"),  # B11: an empty tau table
        (evaluate, ["eval.num_prompts=0"], r"eval.num_prompts=0 must be >= 1"),  # B12: evaluated 1 prompt
        (
            export,
            ["export.serve.num_steps=0", "export.serve.topk=-1"],
            r"export.serve.num_steps=0 must be >= 1.*; export.serve.topk=-1 must be >= 1",
        ),  # B13: landed in serve.sh
        (
            export,
            ["export.engines=[sglang,vlm]"],
            r"export.engines: 'vlm' is not one of \['sglang', 'vllm'\]",
        ),
        # the MLA draft's layout is verified against SGLang's class only: found at export, after training,
        # otherwise
        (
            export,
            ["train.draft_arch=mla"],
            r"train.draft_arch=mla: that layout is verified against sglang only; set "
            r"export.engines=\[sglang\]",
        ),
        # the default 32000 with target=tiny was refused only after prepare and extract ran
        (vocab, ["vocab.draft_vocab_size=32000"], r"vocab.draft_vocab_size=32000: must be in \[1, 1024\]"),
        # issue #35: each ran to exit 0 with a wrong or degraded result
        (train, ["train.max_grad_norm=-1"], r"train.max_grad_norm=-1.0 must be >= 0"),  # flipped the gradient
        (train, ["train.warmup_steps=-5"], r"train.warmup_steps=-5 must be >= 0"),
        (extract, ["extract.limit=0"], r"extract.limit=0 must be >= 1"),  # a complete, empty store
        (extract, ["extract.limit=-3"], r"extract.limit=-3 must be >= 1"),
        (prepare, ["prepare.max_assistant_turns=0"], r"prepare.max_assistant_turns=0 must be >= 1"),
    ],
)
def test_bad_settings_are_refused_before_the_stage_works(make_cfg, stage, overrides, message):
    """Through the runner's preflight: ranges are config_limits', the rest the stage's own check."""
    with pytest.raises(UserError, match=message):
        preflight(make_cfg("+experiment=tiny", *overrides), [stage.__name__.rsplit(".", 1)[-1]])


@pytest.mark.parametrize("stage", [train, evaluate, export, vocab])
def test_the_shipped_experiments_pass_their_checks(make_cfg, stage):
    for experiment in ("tiny", "demo", "gpu_smollm2", "gpu_smollm2_large", "gpu_qwen25_coder"):
        stage.check(make_cfg(f"+experiment={experiment}"))


def test_stage_all_reports_every_stage_problem_before_anything_runs(make_cfg, tmp_path):
    from pipeline.runner import run_stages

    cfg = make_cfg(
        "+experiment=tiny", "train.lr=0", "eval.max_draft=0", "export.serve.topk=0", run_dir=tmp_path / "r"
    )
    with pytest.raises(UserError) as e:
        run_stages(cfg)
    assert all(
        s in str(e.value)
        for s in (
            "train.lr=0",
            "export.serve.topk=0 must be >= 1",
            "eval.max_draft=0 must be >= 1",
        )
    )
    assert not (tmp_path / "r").exists()  # nothing was written: prepare never started


def test_a_path_given_to_the_tiny_target_is_refused_not_ignored(make_cfg, tmp_path):
    from pipeline.models import targets

    with pytest.raises(UserError, match="target.path=/nope with target.source=tiny"):
        targets.resolve(make_cfg("target=tiny", "target.path=/nope").target, tmp_path)


def test_stage_all_with_no_held_out_samples_is_refused_before_anything_runs(make_cfg, tmp_path):
    from pipeline.runner import run_stages

    with pytest.raises(
        UserError, match="train.val_fraction=0 holds out no samples, and evaluate prompts only"
    ):
        run_stages(make_cfg("+experiment=tiny", "train.val_fraction=0", run_dir=tmp_path / "r"))
    assert not (tmp_path / "r").exists()


def test_val_fraction_0_with_data_mix_held_out_sets_is_not_refused(make_cfg, tmp_path):
    """data=mix holds out conversations per source and train validates on exactly those: val_fraction is
    unused."""
    from pipeline.runner import preflight

    preflight(
        make_cfg("+experiment=tiny", "data=mix", "train.val_fraction=0", run_dir=tmp_path / "r"),
        ["train", "evaluate"],
    )
    with pytest.raises(UserError, match="train.val_fraction=0 holds out no samples"):
        preflight(
            make_cfg(
                "+experiment=tiny",
                "data=mix",
                "train.val_fraction=0",
                "data.sources=[{format:chitchat,heldout:0}]",
                run_dir=tmp_path / "r",
            ),
            ["train", "evaluate"],
        )


def test_evaluate_of_a_draft_trained_without_held_out_samples_names_val_fraction_not_prompt_tokens(
    make_cfg, tmp_path
):
    import json

    final = tmp_path / "train" / "final"
    final.mkdir(parents=True)
    (final / "train_summary.json").write_text(json.dumps({"val_samples": [], "tau_probe_half": "selection"}))
    with pytest.raises(UserError, match=r"trained with no held-out samples \(train.val_fraction=0\)"):
        heldout_prompts(make_cfg("+experiment=tiny", run_dir=tmp_path), store=None, n=3, prompt_tokens=512)


def test_train_on_cuda_without_cuda_is_refused_not_run_on_the_cpu(make_cfg, monkeypatch):
    """issue #35: train.device=cuda on a machine without CUDA trained on the CPU under bf16 autocast."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match=r"train.device=cuda but this machine has no CUDA"):
        train.check(make_cfg("+experiment=tiny", "train.device=cuda"))
    train.check(make_cfg("+experiment=tiny", "train.device=cpu"))
