"""Print the EAGLE-3 draft's shape and parameter count for a target, built on the meta device (no memory).

python scripts/draft_shape.py target=kimi_k25        # hidden 7168, fc 21504 -> 7168, ~1.2B own params
"""

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pipeline.capture.aux_layers import aux_layer_ids  # noqa: E402
from pipeline.config import register  # noqa: E402
from pipeline.models import draft  # noqa: E402

register()
with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
    cfg = compose(config_name="config", overrides=sys.argv[1:])
aux = aux_layer_ids(cfg.extract.aux_layers, cfg.target.num_layers)
model = draft.build_on_meta(cfg.target, cfg.vocab.draft_vocab_size, aux, cfg.train.ttt_steps)
for name, p in model.named_parameters():
    frozen = "" if p.requires_grad else "  (frozen)"
    print(f"{name:<45}{str(tuple(p.shape)):<22}{p.numel():>15,}{frozen}  {p.device}")
print(
    f"\n{cfg.target.name}: aux layers {aux}, fc {model.fc.in_features} -> {model.fc.out_features}, "
    f"draft vocab {cfg.vocab.draft_vocab_size}; own parameters {draft.own_parameters(model):,} "
    f"(+ {model.embed_tokens.weight.numel():,} embedding shared with the target)"
)
