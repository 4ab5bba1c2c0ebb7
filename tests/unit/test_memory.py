"""The memory model of `eaglepipe plan` (pipeline/models/memory.py) against the bytes the real draft keeps.

The real Eagle3DraftModel (random init, two shapes whose dims all differ, so a term counted at the wrong width
shows) runs one TTT forward and backward under LiveTensors, in fp32 and under bf16 autocast (the GPU's
setting). After the forward, the live bytes are the activations (+ autocast's cached bf16 weights); the peak
of
the backward is bounded by activations + gradients (+ the cache)."""

import pytest
import torch

from pipeline.models import memory

SHAPES = [  # H, I, heads, kv heads, head dim, draft vocab, tokens, TTT steps
    (384, 896, 6, 2, 80, 1200, 256, 3),
    (256, 1024, 8, 2, 48, 700, 192, 5),
]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dims", SHAPES, ids=["wide-heads", "long-ttt"])
def test_the_activation_terms_are_what_the_real_draft_keeps(dims, bf16):
    s = memory.DraftShape(dims[6], dims[7], *dims[:6])  # tokens, TTT steps, then the layer's dims
    after_forward, peak, params = memory.measure_draft(s, bf16)
    acts = sum(memory.activation_terms(s, bf16).values())
    cache = 2 * params.linear_trainable if bf16 else 0
    assert abs(acts + cache - after_forward) <= 0.01 * after_forward, (acts + cache, after_forward)
    # + the loss's backward working set or the gradients, whichever is larger (they do not coexist)
    bound = acts + cache + max(4 * params.trainable, memory.loss_backward_bytes(s))
    assert 0.85 * bound <= peak <= bound, (peak, bound)


def test_fsdp_divides_the_static_state_and_ddp_adds_its_buckets():
    s = memory.DraftShape(8192, 7, 7168, 18432, 64, 64, 128, 32000)
    p = memory.DraftParams(
        trainable=961_572_864,
        frozen=1_633_164_288,
        largest_unit=1_174_405_120,
        linear_trainable=961_544_192,
        largest_trainable_unit=807_411_712,
    )
    one, ddp, fsdp = (memory.estimate(s, p, n, how) for n, how in ((1, "ddp"), (8, "ddp"), (8, "fsdp")))
    assert (
        ddp["parts"]["DDP gradient buckets (fp32)"] == 4 * p.trainable
        and "DDP gradient buckets (fp32)" not in one["parts"]
    )
    assert fsdp["parts"]["AdamW moments (fp32 x 2)"] == ddp["parts"]["AdamW moments (fp32 x 2)"] / 8
    assert (
        fsdp["peak"] < ddp["peak"]
        and one["parts"]["activations (TTT forward, kept for backward)"]
        == fsdp["parts"]["activations (TTT forward, kept for backward)"]
    )
    with pytest.raises(ValueError, match="ddp or fsdp"):
        memory.estimate(s, p, 8, "zero3")


def test_plan_sizes_the_kimi_k25_draft_from_its_declared_shape(make_cfg):
    from pipeline.tools import plan

    over = ["target=kimi_k25", "train.tokens_per_pack=8192", "train.ttt_steps=7", "plan.world_size=8"]
    ddp, fsdp = (plan.compute(make_cfg(*over, f"train.strategy={how}")) for how in ("ddp", "fsdp"))
    assert ddp["params"]["trainable"] == 961_572_864 and ddp["params"]["frozen"] == 1_633_164_288
    assert ddp["aux_layer_ids"] == [1, 29, 57] and ddp["fits"] and fsdp["peak"] < ddp["peak"]


def test_plan_refuses_a_target_without_a_declared_layer_shape_in_one_line(make_cfg):
    from pipeline.errors import UserError
    from pipeline.tools import plan

    with pytest.raises(UserError, match=r"target tiny-llama declares no num_attention_heads.*conf/target/"):
        plan.compute(make_cfg("target=tiny"))


def test_a_dense_targets_parameters_from_its_declared_shape_are_the_published_count(make_cfg):
    """Llama-3.1-8B declares no num_parameters: the dense estimate from its layer shape is Meta's
    8,030,261,248."""
    from pipeline.tools import plan

    cfg = make_cfg("target=llama3_8b")
    assert plan.target_parameters(cfg, plan.shape_of(cfg)) == (
        8_030_261_248,
        "dense estimate from the layer shape",
    )


def test_plan_counts_the_targets_weights_that_online_features_and_the_tau_probe_hold(make_cfg):
    """train.features=online: every rank holds the bf16 target; train.eval_tau_every_steps: rank 0 holds it
    in fp32
    (eval.device). Kimi-K2.5's 1.04T parameters make both impossible on one H200, and plan says so."""
    from pipeline.tools import plan

    base = ["target=llama3_8b", "train.tokens_per_pack=8192", "train.ttt_steps=7"]
    off = plan.compute(make_cfg(*base))
    online = plan.compute(make_cfg(*base, "train.features=online"))
    probe = plan.compute(make_cfg(*base, "train.eval_tau_every_steps=100"))
    probe_cpu = plan.compute(make_cfg(*base, "train.eval_tau_every_steps=100", "eval.device=cpu"))
    n = 8_030_261_248
    assert online["parts"][plan.ONLINE_TARGET] == 2 * n and online["peak"] == off["peak"] + 2 * n
    assert probe["parts"][plan.PROBE_TARGET] == 4 * n and probe["peak"] == off["peak"] + 4 * n
    assert plan.PROBE_TARGET not in probe_cpu["parts"] and probe_cpu["peak"] == off["peak"]
    cpu_plan = plan.compute(
        make_cfg(*base, "train.eval_tau_every_steps=100", "plan.precision=fp32")
    )  # eval.device=auto
    assert (
        plan.PROBE_TARGET not in cpu_plan["parts"]
    )  # auto follows the planned run: on the CPU, not in GPU memory
    kimi = plan.compute(
        make_cfg(
            "target=kimi_k25",
            "train.tokens_per_pack=8192",
            "plan.world_size=8",
            "train.strategy=fsdp",
            "train.features=online",
        )
    )
    assert kimi["target_parameters"] == 1_040_000_000_000 and not kimi["fits"]


def test_attention_pairs_are_the_nonzeros_of_speculators_mask_at_every_ttt_step():
    """The model-FLOPs count of the MFU bench: pairs per TTT step == the dense mask speculators builds (three
    documents and padding), extended by one diagonal block per step as its forward does."""
    from speculators.models.eagle3.attention import (
        create_combined_mask_mod,
        extend_dense_mask_for_draft_tokens,
    )

    doc = torch.tensor([0] * 5 + [1] * 9 + [2] * 3 + [-1] * 4)
    T = doc.numel()
    mod = create_combined_mask_mod(doc, T)
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = mod(torch.tensor(0), torch.tensor(0), q, k)[None, None]
    got = memory.attention_pairs(doc, 4)
    want = []
    for _ in range(4):
        want.append(
            int(mask[0, 0][doc != -1].sum())
        )  # padding's rows keep their diagonals: not the model's work
        mask = extend_dense_mask_for_draft_tokens(mask, T)
    assert got == want
    assert memory.attention_model_flops(doc, 4, heads=2, head_dim=8) == 12 * 2 * 8 * sum(want)


def test_plan_gives_the_head_and_loss_memory_at_each_draft_vocabulary_size_up_to_the_full_one(make_cfg):
    """Issue #37: at Qwen2.5's 151,936 ids the loss (linear in the draft vocabulary) is what grows; the
    configured size is among the rows, and the full vocabulary is the last."""
    from pipeline.tools import plan

    cfg = make_cfg("target=qwen25_coder", "vocab.draft_vocab_size=24000")
    sizes = [8192, 16384, 24000, 32768, 65536, 151936]
    rows = plan.by_draft_vocab(cfg)
    assert [r["draft_vocab"] for r in rows] == sizes
    assert [r["lm_head_parameters"] for r in rows] == [k * 896 for k in sizes]
    loss = [r["loss_bytes"] for r in rows]
    assert loss == sorted(loss) and loss[-1] / loss[0] == pytest.approx(151936 / 8192, rel=0.01)
    assert [r["peak"] for r in rows] == sorted(r["peak"] for r in rows)
    assert rows[2]["peak"] == plan.compute(cfg)["peak"]  # the row of the configured size is the plan's own
