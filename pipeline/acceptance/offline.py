"""The offline bench of stage `evaluate` (no server): greedy chain speculative decoding, HF target + the
exported draft.

The draft runs through `ExportedDraft`, a small re-implementation of SGLang's Eagle3 draft forward that reads
exactly the tensors and config of run_dir/export/sglang (midlayer.*, fc, norm, lm_head, d2t; the embedding
is the target's, as SGLang shares it): a layout bug shows up as collapsed acceptance. The target runs with a
KV cache and the same aux layers captured by hooks. Reports tau = tokens per target forward (bonus token
included) and acceptance per draft position, pooled and per prompt, for draft lengths 1..max, next to an
untrained draft (the floor); checks the speculative output equals plain greedy decoding token for token.
Entry: `measure(cfg, store, prompts, out)`, the same shape as online_bench.measure; writes
out/acceptance.json.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pipeline.acceptance import batched
from pipeline.capture.hf import Capture
from pipeline.formats import export_layouts as lay
from pipeline.formats.run_dir import RunDir
from pipeline.models import draft as draft_lib
from pipeline.models import targets

log = logging.getLogger(__name__)


class ExportedDraft:
    """SGLang's EAGLE-3 draft forward (one layer, no tree), from an export's tensors, in fp32:
    LlamaForCausalLMEagle3
    (GQA attention) or Eagle3DeepseekV2ForCausalLM (multi-latent attention), whichever its config.json
    names."""

    def __init__(self, tensors: dict, config: dict, embed: torch.Tensor, device: torch.device | str = "cpu"):
        self.w = {k: (v.float() if v.is_floating_point() else v).to(device) for k, v in tensors.items()}
        self.c, self.embed = config, embed.float().to(device)
        self.heads = config["num_attention_heads"]
        self.eps = config["rms_norm_eps"]
        self.mla = lay.draft_arch_of_export(config).name == "mla"
        if self.mla:
            self.nope, self.rope_dim, self.vd = (
                config["qk_nope_head_dim"],
                config["qk_rope_head_dim"],
                config["v_head_dim"],
            )
            self.kv_lora = config["kv_lora_rank"]
            self.rotary, self.scale = _mla_rotary(config)
            self.rotary = self.rotary.to(device)
        else:
            self.kv = config["num_key_value_heads"]
            self.hd = config.get("head_dim") or config["hidden_size"] // self.heads
            self.rotary = _rotary(config, self.hd).to(
                device
            )  # the rope the config names (yarn for Kimi), as trained
        self.d2t = self.w["d2t"]

    def _rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def _rope(self, x, pos, half: int):
        """x [B, heads, N, d] rotated (half-split) at positions pos [B, N]."""
        cos, sin = self.rotary(x, pos)  # [B, N, d], attention scaling (yarn's mscale) included
        cos, sin = cos[:, None], sin[:, None]
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return aux.float() @ self.w["fc.weight"].T

    def inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's 2H input at each position: cat(input_layernorm(embed(token)), hidden_norm(hidden))."""
        e = self._rms(self.embed[tokens], "midlayer.input_layernorm.weight")
        return torch.cat([e, self._rms(hidden, "midlayer.hidden_norm.weight")], -1)

    def qkv(self, x: torch.Tensor, pos: torch.Tensor):
        """(q, k, v), each [B, heads, N, d], of inputs x [B, N, 2H] at positions pos [B, N]; k and v per head
        (GQA
        repeated, MLA expanded from the latent), so a cache of them is attention's whole input."""
        return (self._mla if self.mla else self._gqa)(x, pos)

    def _gqa(self, x: torch.Tensor, pos: torch.Tensor):
        p, w, (B, N) = "midlayer.self_attn.", self.w, x.shape[:2]
        q = (x @ w[p + "q_proj.weight"].T).view(B, N, self.heads, self.hd).transpose(1, 2)
        k = (x @ w[p + "k_proj.weight"].T).view(B, N, self.kv, self.hd).transpose(1, 2)
        v = (x @ w[p + "v_proj.weight"].T).view(B, N, self.kv, self.hd).transpose(1, 2)
        q, k = self._rope(q, pos, self.hd // 2), self._rope(k, pos, self.hd // 2)
        rep = self.heads // self.kv
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def _mla(self, x: torch.Tensor, pos: torch.Tensor):
        """Multi-latent attention, unabsorbed: q through its LoRA, one shared latent (kv_lora) + one shared
        rope key
        per token, expanded per head by kv_b; the rope part rotated GPT-J style (interleaved pairs), as
        DeepseekV2AttentionMLA's is_neox_style=False."""
        p, w, (B, N), H = "midlayer.self_attn.", self.w, x.shape[:2], self.heads
        q = self._rms(x @ w[p + "q_a_proj.weight"].T, p + "q_a_layernorm.weight") @ w[p + "q_b_proj.weight"].T
        q = q.view(B, N, H, self.nope + self.rope_dim).transpose(1, 2)
        ckv = x @ w[p + "kv_a_proj_with_mqa.weight"].T
        latent, k_rot = ckv[..., : self.kv_lora], ckv[..., self.kv_lora :]
        kv = (self._rms(latent, p + "kv_a_layernorm.weight") @ w[p + "kv_b_proj.weight"].T).view(
            B, N, H, self.nope + self.vd
        )
        k_nope, v = kv[..., : self.nope].transpose(1, 2), kv[..., self.nope :].transpose(1, 2)

        def rot(t):  # interleaved pairs (x0, x1), (x2, x3), ... -> halves, then the half-split rotation
            t = t.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
            return self._rope(t, pos, self.rope_dim // 2)

        q_rot, k_rot = rot(q[..., self.nope :]), rot(k_rot[:, None])
        q = torch.cat([q[..., : self.nope], q_rot], -1)
        return q, torch.cat([k_nope, k_rot.expand(-1, H, -1, -1)], -1), v

    def attend(self, q, k, v, mask=None, causal: bool = False) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale if self.mla else None
        )

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + o_proj of attention [B, heads, N, dv] over the raw hidden input [B, N, H], then the
        MLP."""
        p, w = "midlayer.", self.w
        h = hidden + attn.transpose(1, 2).flatten(2) @ w[p + "self_attn.o_proj.weight"].T
        y = self._rms(h, p + "post_attention_layernorm.weight")
        mlp = (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"
        ].T
        return h + mlp

    def layer(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The layer over one sequence ([T] tokens, [T, H] hidden, [T] positions), causal: outputs [T, H]."""
        q, k, v = self.qkv(self.inputs(tokens[None], hidden[None]), pos[None])
        return self.finish(hidden[None], self.attend(q, k, v, causal=True))[0]

    def logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        return self._rms(out_hidden, "norm.weight") @ self.w["lm_head.weight"].T

    def next_target_id(self, out_hidden: torch.Tensor) -> int:
        d = int(torch.argmax(self.logits(out_hidden)))
        return d + int(self.d2t[d])

    def next_target_ids(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B] target ids, on the device."""
        d = self.logits(out_hidden).argmax(-1)
        return d + self.d2t[d]


def _rotary(config: dict, head_dim: int):
    """transformers' Llama rotary embedding for the export's rope (default, yarn, ...): the one the draft
    trained
    with (speculators builds its layer from a LlamaConfig) and the one SGLang's Llama draft reads from
    config.json."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = dict(config.get("rope_parameters") or {"rope_type": "default"})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    return LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=config["hidden_size"],
            head_dim=head_dim,
            num_attention_heads=config["num_attention_heads"],
            max_position_embeddings=config["max_position_embeddings"],
            rope_parameters=rope,
        )
    )


def _mla_rotary(config: dict):
    """(transformers' DeepSeek-V3 rotary embedding for the export's rope, the softmax scale): what the MLA
    draft
    trained with, and what DeepseekV2AttentionMLA computes from the same config (yarn: mscale on both)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        yarn_apply_mscale,
    )

    rope = dict(config.get("rope_parameters") or {"rope_type": "default"})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    c = DeepseekV3Config(
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        max_position_embeddings=config["max_position_embeddings"],
        rope_parameters=rope,
    )
    scale = yarn_apply_mscale(
        c.rope_parameters, (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
    )
    return DeepseekV3RotaryEmbedding(c), scale


@torch.no_grad()
def speculate(
    model, capture: Capture, dr: ExportedDraft, prompt: list[int], max_new: int, k: int, eos: int | None
):
    """Greedy chain speculative decoding. Returns (generated ids, accepted-per-round list)."""
    from transformers import DynamicCache

    dev = model.device
    past = DynamicCache()
    out = model(input_ids=torch.tensor([prompt], device=dev), past_key_values=past, use_cache=True)
    aux = capture.states()[0][0]
    nxt = int(out.logits[0, -1].argmax())
    ctx_tok, ctx_hid = prompt[1:] + [nxt], dr.fuse(aux)  # draft input at position t: token t+1, fused aux t
    generated, rounds = [nxt], []
    while len(generated) < max_new and nxt != eos:
        tok, hid, props = list(ctx_tok), ctx_hid, []
        for _ in range(k):  # the chain: each step feeds the draft's own output hidden state back
            pos = torch.arange(1, len(tok) + 1, device=dev)
            h = dr.layer(torch.tensor(tok, device=dev), hid, pos)[-1]
            props.append(dr.next_target_id(h))
            tok, hid = tok + [props[-1]], torch.cat([hid, h[None]])
        out = model(input_ids=torch.tensor([[nxt] + props], device=dev), past_key_values=past, use_cache=True)
        verify = out.logits[0].argmax(-1).tolist()
        a = 0
        while a < k and verify[a] == props[a]:
            a += 1
        new = props[:a] + [verify[a]]
        aux = capture.states()[0][0, : a + 1]
        if a < k:
            past.crop(-(k - a))  # keep nxt and the accepted proposals: drop the k - a rejected ones
        ctx_tok, ctx_hid = ctx_tok + new, torch.cat([ctx_hid, dr.fuse(aux)])
        rounds.append(a)
        for t in new:
            generated.append(t)
            if t == eos or len(generated) >= max_new:
                break
        nxt = generated[-1]
    return generated[:max_new], rounds


def teacher_forced(
    model, capture: Capture, dr: ExportedDraft, prompt: list[int], continuation: list[int]
) -> torch.Tensor:
    """Step-0 hits of the draft along the target's own continuation, teacher-forced as training's acc_0 is: at
    each position t from the prompt's last token on, the draft reads the target's aux states of the sequence
    up to
    t and token t+1, and hits when its proposal is token t+2. Returns a bool per continuation token after the
    first
    ([len(continuation) - 1]). Speculation at k = 1 asks exactly these questions, but only at the positions
    where
    rounds start (after an accepted proposal it skips the verifier's bonus token), so its first-position
    acceptance
    is this accuracy at a sample of positions that leans toward where the draft failed."""
    seq, P = prompt + continuation, len(prompt)
    dev = model.device
    model(input_ids=torch.tensor([seq], device=dev))
    aux = capture.states()[0][0]
    out = dr.layer(
        torch.tensor(seq[1:], device=dev), dr.fuse(aux[:-1]), torch.arange(1, len(seq), device=dev)
    )
    return dr.next_target_ids(out[P - 1 : len(seq) - 2]) == torch.tensor(seq[P + 1 :], device=dev)


# inside one_target(): {"on": True, "key": what was loaded, "target": the tuple _target returns}
_HELD: dict = {}


@contextmanager
def one_target():
    """Inside it, every _target call returns one loaded target (evaluate: its prompt sets and mt_bench_turn2's
    first answers share one load of the fp32 target, not one each); on exit its hooks go and, once the
    callers'
    references are gone, its memory goes back to the device. Not nestable (evaluate.run holds the one)."""
    if _HELD.get("on"):
        raise RuntimeError("offline.one_target() is already held")
    _HELD["on"] = True
    try:
        yield
    finally:
        held = _HELD.pop("target", None)
        _HELD.clear()
        if held is not None:
            device = held[2]
            held[4].remove()  # the hooks hold the model
            del held
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _target(cfg, store):
    """(folder, tokenizer, device, model, capture hooks): the target in fp32 on eval.device (fp32: greedy
    equality is exact, not bf16-noisy). Inside one_target(), the one it holds (the first one loaded)."""
    folder = Path(store.facts["target_path"])
    device, _ = targets.pick_device_dtype(cfg.eval.device, "fp32")
    key = (str(folder), str(device), tuple(store.aux_layer_ids))
    if _HELD.get("key") == key:
        return _HELD["target"]
    model = targets.load_model(folder, cfg.target, device, torch.float32, "sdpa")
    target = (
        folder,
        targets.load_tokenizer(folder, cfg.target),
        device,
        model,
        Capture(model, store.aux_layer_ids),
    )
    if _HELD.get("on") and "target" not in _HELD:
        _HELD.update(key=key, target=target)
    return target


def _done(target) -> None:
    """After a use: its hooks go now (without that, the fp32 copy outlives every reference), unless
    one_target()
    holds it for the next use."""
    if _HELD.get("target") is not target:
        target[4].remove()


def greedy_answers(cfg, store, prompts: list[list[int]], max_new: int) -> list[str]:
    """The target's own greedy answer to each prompt (fp32 on eval.device, eval.batch_size prompts at a
    time), at most
    max_new tokens, decoded: what evaluate puts before a second turn (mt_bench_turn2)."""
    target = _target(cfg, store)
    _, tok, _, model, capture = target
    size = max(cfg.eval.batch_size, 1)
    try:
        with torch.no_grad():
            ids = [
                g
                for i in range(0, len(prompts), size)
                for g in batched.greedy(model, capture, prompts[i : i + size], max_new, tok.eos_token_id)
            ]
    finally:
        _done(target)
    return [tok.decode(g, skip_special_tokens=True).strip() for g in ids]


def measure(cfg, store, prompts: list[list[int]], out: Path) -> Path:
    """tau of the exported draft (and of an untrained one) over the prompts; out/acceptance.json + tau.png."""
    e = cfg.eval
    export = RunDir.of(cfg).export("sglang")  # its presence is the stage's precondition (evaluate.run)
    target = _target(cfg, store)
    folder, tok, device, model, capture = target
    config = json.loads((export / "config.json").read_text())
    embed = model.get_input_embeddings().weight.detach()
    trained = ExportedDraft(load_file(str(export / "model.safetensors")), config, embed, device)
    untrained = ExportedDraft(untrained_tensors(cfg, store, folder), config, embed, device)
    report = {
        "prompts": len(prompts),
        "max_new_tokens": e.max_new_tokens,
        "draft_lengths": list(range(1, e.max_draft + 1)),
        "batch_size": e.batch_size,
    }
    chunks = [prompts[i : i + e.batch_size] for i in range(0, len(prompts), e.batch_size)]
    eos = tok.eos_token_id
    if e.batch_size > 1:
        greedy_refs = [g for c in chunks for g in batched.greedy(model, capture, c, e.max_new_tokens, eos)]
    else:  # plain greedy decoding, the reference every speculative run must equal
        greedy_refs = [
            model.generate(
                torch.tensor([p], device=device),
                max_new_tokens=e.max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=tok.pad_token_id,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    ks = list(range(1, e.max_draft + 1))
    for name, dr in (("trained", trained), ("untrained", untrained)):
        report[name] = {}
        # batched: every k of a chunk in one pass (eval.batch_size prompts x max_draft rows)
        all_runs = (
            batched.by_k(model, capture, dr, prompts, e.max_new_tokens, ks, eos, e.batch_size)
            if e.batch_size > 1
            else None
        )
        for k in ks:
            runs = (
                all_runs[k]
                if all_runs is not None
                else [speculate(model, capture, dr, p, e.max_new_tokens, k, eos) for p in prompts]
            )
            per_prompt, pooled_rounds, mismatches = [], [], 0
            for (gen, rounds), greedy in zip(runs, greedy_refs):
                mismatches += gen != greedy
                per_prompt.append(sum(r + 1 for r in rounds) / max(len(rounds), 1))
                pooled_rounds += rounds
            accept = [
                sum(r >= i for r in pooled_rounds) / max(sum(r >= i - 1 for r in pooled_rounds), 1)
                for i in range(1, k + 1)
            ]
            report[name][str(k)] = {
                "tau": sum(r + 1 for r in pooled_rounds) / max(len(pooled_rounds), 1),
                "tau_per_prompt": per_prompt,
                "accept_per_position": accept,
                "target_forwards": len(pooled_rounds),
                "greedy_mismatches": mismatches,
            }
            log.info(
                "eval %s draft k=%d: tau %.3f, acceptance per position %s, greedy mismatches %d",
                name,
                k,
                report[name][str(k)]["tau"],
                [round(x, 3) for x in accept],
                mismatches,
            )
        with torch.no_grad():
            rows = [
                teacher_forced(model, capture, dr, p, g).cpu()
                for p, g in zip(prompts, greedy_refs)
                if len(g) > 1
            ]
        hits = torch.cat(rows or [torch.zeros(0, dtype=torch.bool)])
        tf = report.setdefault("teacher_forced_acc_0", {"tokens": len(hits)})
        tf[name] = float(hits.float().mean()) if len(hits) else None
        if name == "trained":  # do misses cluster? the hit rate right after a hit and right after a miss
            prev, nxt = (
                (torch.cat([r[:-1] for r in rows]), torch.cat([r[1:] for r in rows]))
                if rows
                else (hits, hits)
            )
            tf["after_hit"] = float(nxt[prev].float().mean()) if prev.any() else None
            tf["after_miss"] = float(nxt[~prev].float().mean()) if (~prev).any() else None
    # step-0 accuracy along the target's greedy continuations, beside training's own (its last validation) and
    # the first-position acceptance at k = 1: the same question asked at every position vs where rounds start
    tf = report["teacher_forced_acc_0"]
    tf.update(
        training_val_full_acc_0=_trained_val_acc0(cfg),
        accept_first_position_k1=report["trained"]["1"]["accept_per_position"][0],
    )
    if tf["trained"] is not None:
        log.info(
            "eval trained draft: step-0 accuracy teacher-forced along these continuations %.3f (%s after a "
            "hit, "
            "%s after a miss; training's last val full_acc_0 %s); first-position acceptance at k=1 %.3f "
            "(rounds "
            "start after the draft's misses)",
            tf["trained"],
            _fmt(tf.get("after_hit")),
            _fmt(tf.get("after_miss")),
            _fmt(tf["training_val_full_acc_0"]),
            tf["accept_first_position_k1"],
        )
    _done(target)
    ks = report["draft_lengths"]
    lines = ["tau (tokens per target forward)  " + "".join(f"{'k=' + str(k):>8}" for k in ks)]
    for name, label in (("trained", "trained draft"), ("untrained", "untrained draft (floor)")):
        lines.append(f"{label:<33}" + "".join(f"{report[name][str(k)]['tau']:>8.3f}" for k in ks))
    where = (
        "held-out" if out == RunDir.of(cfg).eval else out.name
    )  # eval/, or eval/<set>/ of another prompt set
    log.info(
        "evaluate, %d %s prompts x %d new tokens:\n%s",
        len(prompts),
        where,
        e.max_new_tokens,
        "\n".join(lines),
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps(report, indent=1))
    _plot(report, out / "tau.png")
    return out


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _trained_val_acc0(cfg):
    """Training's last validation full_acc_0 (train/final/train_summary.json), or None where there is none."""
    summary = RunDir.of(cfg).final / "train_summary.json"
    try:
        return float(json.loads(summary.read_text())["val_after"]["full_acc_0"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def untrained_tensors(cfg, store, folder: Path) -> dict:
    """The floor: speculators' initial draft (same seed, same vocab), through the same SGLang layout."""
    from pipeline.formats import vocab_map

    d2t, t2d, _ = vocab_map.load(RunDir.of(cfg).vocab)
    torch.manual_seed(cfg.seed)
    config = json.loads((RunDir.of(cfg).export("sglang") / "config.json").read_text())
    m = draft_lib.build(
        folder,
        targets.load_config(folder, cfg.target),
        store.aux_layer_ids,
        d2t,
        t2d,
        1,
        arch=lay.draft_arch_of_export(config).name,
    )
    return {lay.speculators_to_sglang_name(k): v.detach() for k, v in lay.draft_owned(m.state_dict()).items()}


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = report["draft_lengths"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name in ("trained", "untrained"):
        ax.plot(ks, [report[name][str(k)]["tau"] for k in ks], "o-", label=name)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("tau (tokens / target forward)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
