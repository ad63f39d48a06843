"""`voxmill audit OUT` and `extract --audit N`: a sample of a finished run, re-extracted in this
process on the CPU reference path and compared with the stored rows (`pipeline.outputs.audit`)."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.outputs.audit import AuditReport, AuditThresholds, audit_run, paths_by_utt, read_stored_rows
from pipeline.outputs.folder import RunFolder
from pipeline.outputs.writers import write_text_at
from pipeline.run.plan import PlanReader
from pipeline.settings import Settings


def audit_output(out_dir: RunFolder, settings: Settings, sample: int, seed: int) -> AuditReport:
    """Audit `sample` utterances of the run in `out_dir` with the models of `settings.model_dir`;
    the report is also written to `out_dir/audit.json`."""
    rows = read_stored_rows(out_dir)
    paths = paths_by_utt((u.utt, u.path) for spec in PlanReader(out_dir).specs() for u in spec.utts)
    thresholds = AuditThresholds.from_settings(settings)
    report = audit_run(rows, paths, Path(settings.model_dir), sample, seed, thresholds, settings.audio_limits)
    write_text_at(out_dir.location, RunFolder.AUDIT, json.dumps(report.to_dict(), indent=1) + "\n")
    return report
