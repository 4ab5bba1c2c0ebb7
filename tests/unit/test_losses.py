"""The chunked KL loss (pipeline/models/losses.py) against speculators' eager kl_div_loss: the same
per-position
values and the same gradients, alone and inside the real draft's TTT forward; and it keeps less memory."""

from types import SimpleNamespace

import pytest
import torch

from pipeline.models import draft, losses, memory


def test_chunked_kl_equals_speculators_eager_kl_and_its_gradient():
    from speculators.losses.eager import kl_div_loss

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, 37, 50, generator=g, dtype=torch.float64) * 3).float().requires_grad_()
    targets = torch.randn(1, 37, 50, generator=g) * 3
    targets[0, 5, :40] = -1e4  # a target with (numerically) zero probabilities: xlogy's 0 where p == 0
    weights = torch.rand(1, 37, generator=g)
    ref = kl_div_loss(logits, targets)
    (ref * weights).sum().backward()
    ref_grad, logits.grad = logits.grad.clone(), None
    got = losses.chunked_kl_div_loss(logits, targets, chunk=8)  # 37 rows: 4 full chunks and a partial one
    (got * weights).sum().backward()
    assert got.shape == ref.shape == (1, 37)
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(logits.grad, ref_grad, rtol=1e-6, atol=1e-7)


def _draft_and_batch(T=160, k=3):
    shape = SimpleNamespace(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        architectures=[],
    )
    torch.manual_seed(0)
    model = draft.build(
        None, shape, [1, 2, 3], None, None, k, attn="sdpa", load_target_weights=False, draft_vocab_size=300
    )
    model.d2t, model.t2d = torch.zeros(300, dtype=torch.long), torch.zeros(512, dtype=torch.bool)
    for p in (
        model.lm_head.weight,
        model.verifier_lm_head.weight,
        model.embed_tokens.weight,
    ):  # not loaded: random
        torch.nn.init.normal_(p, std=0.5)
    g = torch.Generator().manual_seed(1)
    batch = dict(
        hidden_states=torch.randn(1, T, 192, generator=g),
        input_ids=torch.randint(0, 512, (1, T), generator=g),
        document_ids=torch.cat([torch.zeros(90), torch.ones(T - 90)]).long()[None],
        loss_mask=(torch.rand(1, T, generator=g) > 0.3),
        position_ids=torch.arange(T)[None],
        verifier_last_hidden_states=torch.randn(1, T, 64, generator=g),
    )
    return model, batch


@pytest.mark.parametrize("decay", [1.0, 0.8])
def test_in_the_real_ttt_forward_the_loss_metrics_and_gradients_do_not_change(decay):
    out = {}
    for name, config in (
        ("eager", losses.loss_config("kl_div", None)),
        ("chunked", losses.loss_config("kl_div", 64)),
    ):
        model, batch = _draft_and_batch()
        _, loss, metrics = model(**batch, ttt_steps=3, ttt_step_loss_decay=decay, loss_config=config)
        loss.backward()
        out[name] = (
            loss.detach(),
            {k: v.detach() for k, v in metrics.items()},
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )
    (la, ma, ga), (lb, mb, gb) = out["eager"], out["chunked"]
    assert torch.allclose(la, lb, rtol=1e-6) and ma.keys() == mb.keys() and ga.keys() == gb.keys() and ga
    assert all(torch.allclose(ma[k].float(), mb[k].float(), rtol=1e-6, atol=1e-7) for k in ma)
    for n in ga:  # fp32 sums in another order: <= 1e-6 relative, as a tensor (measured ~2e-7)
        assert float((ga[n] - gb[n]).norm() / ga[n].norm()) <= 1e-6, n


def test_the_chunked_loss_keeps_less_and_the_memory_model_says_how_much():
    s = memory.DraftShape(256, 3, 64, 128, 4, 2, 16, 300)
    kept = {
        name: memory.measure_draft(s, False, vocab=512, loss_chunk=chunk)[0]
        for name, chunk in (("eager", None), ("chunked", 64))
    }
    saved = sum(memory.activation_terms(s, False).values()) - sum(
        memory.activation_terms(s, False, 64).values()
    )
    assert kept["chunked"] < kept["eager"]
    assert abs((kept["eager"] - kept["chunked"]) - saved) <= 0.02 * saved, (kept, saved)


def test_the_chunked_loss_is_never_traced_by_dynamo(monkeypatch):
    """speculators compiles the draft's forward on CUDA; torch 2.11's dynamo fails tracing the chunked loss's
    autograd.Function (it stopped every GPU training run at step 1), so there the loss speculators gets must
    be a graph break that runs eagerly: dynamo's own account of a compiled caller shows the break at it, and
    the value
    is the eager one. Without CUDA the function is left as it is (nothing compiles it)."""
    import torch._dynamo

    assert losses.loss_config("kl_div", 4)["kl_div"][0].func is losses.chunked_kl_div_loss  # CPU: unwrapped
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    loss = losses.loss_config("kl_div", 4)["kl_div"][0]  # what a CUDA host builds
    monkeypatch.undo()  # (dynamo itself must not believe in CUDA on this host)

    def caller(logits, targets):
        return loss(logits * 1.0, targets).sum()

    logits, targets = torch.randn(1, 10, 32, requires_grad=True), torch.randn(1, 10, 32)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(caller)(logits, targets)
    assert explained.graph_break_count >= 1
    assert any("disable" in str(r.reason).lower() for r in explained.break_reasons), [
        str(r.reason) for r in explained.break_reasons
    ]
    compiled = torch.compile(caller, backend="eager")(logits, targets)
    assert torch.allclose(compiled, losses.chunked_kl_div_loss(logits, targets, chunk=4).sum())
