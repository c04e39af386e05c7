"""Moved to `hf_loops.core.outdir` (the commands' shared plumbing); kept so that existing imports work."""

from ..core.outdir import *  # noqa: F403
from ..core.outdir import (  # noqa: F401  # noqa: F401
    LAST_FILE,
    TMP_PREFIX,
    atomic_output_dir,
    check_output_dir,
    move_files_into,
    output_lock,
    remove_stale_exports,
)
