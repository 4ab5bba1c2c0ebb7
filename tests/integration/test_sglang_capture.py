"""extract.backend=sglang: the contract suite runs in .venv-engines against SGLang's real classes; here, the
parts that run in the main venv (fail-early message, parity arithmetic on real stores)."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline.engines.verify import ENGINES_PYTHON
from pipeline.errors import UserError
from pipeline.formats.feature_store import FeatureStore
from pipeline.runner import run_stages
from pipeline.tools.parity import compare, relative_errors

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_contract_suite_passes_inside_the_engines_venv(tiny_folder, kimi_folder):
    r = subprocess.run(
        [
            str(ENGINES_PYTHON),
            "-m",
            "pytest",
            "--noconftest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/engine_contract",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "EAGLEPIPE_CONTRACT_TARGET": str(tiny_folder),
            "EAGLEPIPE_CONTRACT_KIMI_TARGET": str(kimi_folder),
            "PYTHONPATH": str(ROOT),
        },
    )
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, (
        r.stdout[-3000:] + r.stderr[-2000:]
    )


def test_backend_sglang_without_sglang_is_one_clear_error(make_cfg, tmp_path):
    with pytest.raises(UserError, match=r"extract.backend=sglang needs sglang 0.5.17 \.\. 0.5.23"):
        run_stages(
            make_cfg(
                "+experiment=tiny",
                "data.limit=4",
                "stage=extract",
                "extract.backend=sglang",
                run_dir=tmp_path,
            )
        )


def test_parity_is_zero_for_one_store_and_flags_a_layer_numbering_slip(exported_run):
    run_dir, facts = exported_run
    store = FeatureStore(run_dir / "features")
    report = compare(store, store)
    assert list(report) == ["aux layer 1", "aux layer 3", "aux layer 4", "last (pre-norm)"]
    assert all(r["max_rel_err"] == 0.0 for r in report.values())
    s = store.sample(0)
    H = store.hidden_size
    shifted = dict(
        s, aux_hidden=torch.cat([s["aux_hidden"][:, H:], s["aux_hidden"][:, :H]], -1)
    )  # off by one layer
    errors = relative_errors(s, shifted, 3, H)
    assert all(float(e.max()) > 0.1 for e in errors[:3]) and float(errors[3].max()) == 0.0
