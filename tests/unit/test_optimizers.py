"""train.optimizer=muon (pipeline/training/optimizers.py): one optimizer over speculators' split, which the LR
schedule reaches, whose state round-trips, and which steps as Muon + AdamW stepped apart would."""

import copy

import torch
from omegaconf import OmegaConf
from transformers import get_scheduler

from pipeline.training import optimizers


class Draftish(
    torch.nn.Module
):  # the names speculators' split reads: matrices, a norm, the embedding, lm_head
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8, bias=False)
        self.norm = torch.nn.LayerNorm(8)
        self.embed_tokens = torch.nn.Embedding(16, 8)
        self.lm_head = torch.nn.Linear(8, 16, bias=False)

    def forward(self, ids):
        return self.lm_head(self.norm(self.fc(self.embed_tokens(ids))))


def cfg(choice):
    return OmegaConf.create(
        dict(
            optimizer=choice,
            lr=1e-2,
            weight_decay=0.0,
            adam_betas=[0.9, 0.95],
            muon_lr=0.02,
            muon_momentum=0.95,
            muon_weight_decay=0.1,
        )
    )


def steps(model, opt, n=3, sched=None):
    torch.manual_seed(0)
    for _ in range(n):
        loss = model(torch.randint(0, 16, (4, 5))).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()


def test_muon_takes_the_matrices_and_adamw_the_rest_and_both_step_as_alone():
    torch.manual_seed(1)
    a = Draftish()
    b = copy.deepcopy(a)
    opt = optimizers.build(cfg("muon"), a)
    assert isinstance(opt, optimizers.MuonAdamW)
    muon, adamw = opt.parts
    assert {id(p) for g in muon.param_groups for p in g["params"]} == {id(a.fc.weight)}
    assert id(a.lm_head.weight) in {id(p) for g in adamw.param_groups for p in g["params"]}
    ref_muon = torch.optim.Muon(
        [b.fc.weight], lr=0.02, momentum=0.95, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    rest = [p for n, p in b.named_parameters() if n != "fc.weight"]
    ref_adamw = torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95))

    class Both:
        def step(self):
            ref_muon.step()
            ref_adamw.step()

        def zero_grad(self):
            ref_muon.zero_grad()
            ref_adamw.zero_grad()

    steps(a, opt)
    steps(b, Both())
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n


def test_the_schedule_reaches_both_parts_and_the_state_round_trips():
    torch.manual_seed(2)
    a = Draftish()
    opt = optimizers.build(cfg("muon"), a)
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=10)
    steps(a, opt, 3, sched)
    assert (
        opt.parts[0].param_groups[0]["lr"] == 0.02 * 0.7
        and abs(opt.parts[1].param_groups[0]["lr"] - 7e-3) < 1e-12
    )
    b = copy.deepcopy(a)
    opt_b = optimizers.build(cfg("muon"), b)
    sched_b = get_scheduler("linear", opt_b, num_warmup_steps=0, num_training_steps=10)  # as a resume does
    opt_b.load_state_dict(copy.deepcopy(opt.state_dict()))
    sched_b.load_state_dict(sched.state_dict())
    steps(a, opt, 2, sched)
    steps(b, opt_b, 2, sched_b)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)  # resumed from the state: the same steps


def test_adamw_is_the_default_and_plain():
    opt = optimizers.build(cfg("adamw"), Draftish())
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_a_muon_run_trains_checkpoints_and_resumes_to_the_same_weights(make_cfg, tmp_path, caplog):
    """Through the real stage (accelerate, checkpoints): 40 steps on tiny with Muon; the same run with its
    last checkpoint and final removed resumes from step 30 and ends on the same bytes."""
    import logging

    caplog.set_level(logging.INFO)
    import shutil

    from safetensors.torch import load_file

    from pipeline.runner import run_stages

    cfg = make_cfg(
        "+experiment=tiny", "train.optimizer=muon", "export.verify_in_engine=false", run_dir=tmp_path
    )
    run_stages(cfg)
    root = tmp_path / "train"
    summary = (root / "final" / "train_summary.json").read_text()
    assert '"optimizer": "muon"' in summary
    before = load_file(str(root / "final" / "model.safetensors"))
    shutil.rmtree(root / "final")
    shutil.rmtree(root / "step_000040")
    (tmp_path / "stages.json").unlink()
    caplog.clear()
    run_stages(cfg)
    assert any("resumed from" in r.message and "step 30" in r.message for r in caplog.records)
    after = load_file(str(root / "final" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
