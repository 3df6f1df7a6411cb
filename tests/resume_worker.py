"""Two ranks choose the checkpoint to resume in RUN_DIR (tests/test_checkpoint_integrity.py).
``rank1-view``: rank 1 cannot read the newest checkpoint's manifest (a node whose view of the
file system lags), as if the part were not there yet."""

import sys
from pathlib import Path

from rank_report import report  # tests/, the script's own directory

from rlhf.runtime import manifest, resume
from rlhf.runtime.dist import init_distributed, rank, teardown

run_dir, where = Path(sys.argv[1]), sys.argv[2]
init_distributed("cpu")
if where == "rank1-view" and rank() == 1:
    newest = max((run_dir / "checkpoints").iterdir())
    listed = manifest.listed

    def lagging(path):
        if path == newest:
            raise manifest.ManifestProblem("no manifest-rank00001.json (not seen yet)")
        return listed(path)

    resume.listed = lagging
chosen = resume.resume_point(run_dir, "auto")
report(f"rank {rank()} resumes {chosen.name}")
teardown()
