"""The memory model of `eaglepipe plan` (pipeline/models/memory.py) against the bytes the real draft keeps.

The real Eagle3DraftModel (random init, two shapes whose dims all differ, so a term counted at the wrong width
shows) runs one TTT forward and backward under LiveTensors, in fp32 and under bf16 autocast (the GPU's
setting). After the forward, the live bytes are the activations (+ autocast's cached bf16 weights); the peak of
the backward is bounded by activations + gradients (+ the cache)."""

import pytest

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
    p = memory.DraftParams(trainable=961_572_864, frozen=1_633_164_288, largest_unit=1_174_405_120,
                           linear_trainable=961_544_192, largest_trainable_unit=807_411_712)
    one, ddp, fsdp = (memory.estimate(s, p, n, how) for n, how in ((1, "ddp"), (8, "ddp"), (8, "fsdp")))
    assert ddp["parts"]["DDP gradient buckets (fp32)"] == 4 * p.trainable and "DDP gradient buckets (fp32)" not in one["parts"]
    assert fsdp["parts"]["AdamW moments (fp32 x 2)"] == ddp["parts"]["AdamW moments (fp32 x 2)"] / 8
    assert fsdp["peak"] < ddp["peak"] and one["parts"]["activations (TTT forward, kept for backward)"] == \
        fsdp["parts"]["activations (TTT forward, kept for backward)"]
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
