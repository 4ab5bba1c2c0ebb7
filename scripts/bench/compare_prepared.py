"""Compare two prepared sets of the same conversations (issue #10 item 3: regeneration through SGLang vs local HF).

Usage: python scripts/bench/compare_prepared.py RUN_DIR_A RUN_DIR_B   (prints JSON)
Assistant turns are the runs of loss_mask == 1 in each sample; samples are matched by sample_id. Reports how
many samples and turns are token-for-token equal, the share of the first turn that agrees before the first
differing token, and each run's prepare time (stages.json) and regeneration stats (prepared/stats.json).
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pipeline.formats import prepared  # noqa: E402


def turns(ids: list[int], mask: list[int]) -> list[list[int]]:
    out, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def compare(dir_a: str, dir_b: str) -> dict:
    (da, sa), (db, sb) = prepared.load(dir_a), prepared.load(dir_b)
    by_id = {sid: i for i, sid in enumerate(db["sample_id"])}
    samples = equal_samples = n_turns = equal_turns = 0
    first_turn_prefix, first_turn_len = 0, 0
    for i, sid in enumerate(da["sample_id"]):
        j = by_id.get(sid)
        if j is None:
            continue
        ta, tb = turns(da[i]["input_ids"], da[i]["loss_mask"]), turns(db[j]["input_ids"], db[j]["loss_mask"])
        samples += 1
        equal_samples += int(ta == tb)
        for k, (x, y) in enumerate(zip(ta, tb)):
            n_turns += 1
            equal_turns += int(x == y)
            if k == 0:
                first_turn_prefix += common_prefix(x, y)
                first_turn_len += max(len(x), len(y))
            if x != y:
                break  # later turns are answers to different conversations
    def stage_s(d):
        p = Path(d) / "stages.json"
        return json.loads(p.read_text()).get("prepare", {}).get("seconds") if p.exists() else None
    return {"a": dir_a, "b": dir_b, "samples_matched": samples, "samples_equal": equal_samples,
            "turns_compared_until_first_difference": n_turns, "turns_equal": equal_turns,
            "first_turn_tokens_agreeing_before_first_difference": first_turn_prefix / first_turn_len
            if first_turn_len else None,
            "prepare_s": {"a": stage_s(dir_a), "b": stage_s(dir_b)},
            "regeneration": {"a": sa.get("regenerate"), "b": sb.get("regenerate")},
            "supervised_tokens": {"a": sa.get("supervised_tokens"), "b": sb.get("supervised_tokens")}}


if __name__ == "__main__":
    print(json.dumps(compare(sys.argv[1], sys.argv[2]), indent=1))
