"""The run directory (docs/stages.md, "runs/<run_name>/"): every folder a stage writes, named once, and the
artefacts that several stages and tools read, opened once and checked.

    rd = RunDir.of(cfg)
    rd.features            # run_dir/features (extract writes it)
    rd.open_features()     # the store, refused in one line if missing or incomplete
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def of(cls, cfg) -> RunDir:
        return cls(Path(cfg.run_dir))

    # one folder per stage, in data-flow order
    @property
    def prepared(self) -> Path:
        return self.root / "prepared"

    @property
    def features(self) -> Path:
        return self.root / "features"

    @property
    def vocab(self) -> Path:
        return self.root / "vocab"

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def final(self) -> Path:
        """The trained draft (speculators' save_pretrained + train_summary.json)."""
        return self.train / "final"

    @property
    def exports(self) -> Path:
        return self.root / "export"

    def export(self, engine: str) -> Path:
        return self.exports / engine

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def parity(self) -> Path:
        return self.root / "parity"

    @property
    def tune(self) -> Path:
        """`eaglepipe tune-serve`'s table (serve_sweep.json) and its servers' logs."""
        return self.root / "tune"

    # the artifacts several stages and tools read: each file named by its format module
    @property
    def prepared_stats(self) -> Path:
        from pipeline.formats import prepared

        return self.prepared / prepared.STATS

    @property
    def features_manifest(self) -> Path:
        from pipeline.formats import feature_store

        return self.features / feature_store.MANIFEST

    @property
    def vocab_manifest(self) -> Path:
        from pipeline.formats import vocab_map

        return self.vocab / vocab_map.MANIFEST

    @property
    def train_summary(self) -> Path:
        from pipeline.formats import train_summary

        return train_summary.path(self.final)

    def export_manifest(self, engine: str) -> Path:
        from pipeline.formats import export_layouts

        return self.export(engine) / export_layouts.MANIFEST

    # the runner's records
    @property
    def stages_json(self) -> Path:
        return self.root / "stages.json"

    @property
    def lock(self) -> Path:
        """Who runs in this run dir now (formats/run_lock.py): one run at a time."""
        from pipeline.formats import run_lock

        return run_lock.path(self.root)

    @property
    def summary_md(self) -> Path:
        return self.root / "summary.md"

    def open_features(self, complete: bool = True):
        """The feature store; one line naming the fix if there is none, or (complete=True) if extract has
        not finished it."""
        from pipeline.formats import feature_store as fs

        try:
            store = fs.FeatureStore(self.features)
        except fs.Damaged as e:  # its message carries its own fix
            raise UserError(str(e)) from None
        except fs.StoreError as e:
            raise UserError(f"{e}; run stage=extract first") from None
        if complete and not store.manifest.get("complete"):
            raise UserError(
                f"the feature store in {self.features} is incomplete; rerun stage=extract (it resumes)"
            )
        return store
