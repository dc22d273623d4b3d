"""megabase pipeline stages: one module per stage, a plain function plus a thin Flyte task.

Importing the package sends the ``megabase.*`` loggers (stage starts, SFT/RL steps, verify
and evaluate results) to stderr at INFO, in every process of a run, Elastic workers
included: the progress a user watches when stdout is not a terminal (tqdm bars are off
then). ``MEGABASE_LOG_LEVEL`` (e.g. ``WARNING``) changes the level.
"""

import logging
import os


def _stage_logging() -> None:
    log = logging.getLogger("megabase")
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(os.environ.get("MEGABASE_LOG_LEVEL", "INFO").upper())
    log.propagate = False


_stage_logging()
