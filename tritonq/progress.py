"""The one progress bar every tritonq loop uses (loading, generating, scoring, calibrating).

A plain-text tqdm bar on stderr that stays when done (leave=True) and always ends at 100% (tqdm draws the
final state on close). On a terminal it redraws every 0.1 s; elsewhere (a log file, a notebook, CI) every
30 s, so a log holds a few lines rather than one per update. Never the notebook widget: a stored notebook
keeps the widget's text fallback, frozen at whatever it showed when the cell was saved.
"""
from __future__ import annotations

import sys

TERMINAL_INTERVAL_S = 0.1
LOG_INTERVAL_S = 30.0


def progress_bar(*, total: int | None, desc: str, unit: str, enabled: bool = True, **kwargs):
    """A tqdm.std bar over `total` units, or a disabled (silent) one when not enabled."""
    from tqdm.std import tqdm

    interactive = getattr(sys.stderr, "isatty", lambda: False)()
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=True, file=sys.stderr,
                mininterval=TERMINAL_INTERVAL_S if interactive else LOG_INTERVAL_S, dynamic_ncols=interactive,
                **kwargs)
