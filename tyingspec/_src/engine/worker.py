"""The worker process's entry point (see :mod:`tyingspec._src.engine.isolation`).

The parent starts ``python -c BOOTSTRAP CONN TRACKER PATH...`` (``_isolation.BOOTSTRAP``): the
bootstrap's first act is to make the parent's ``sys.path`` its own (so that user modules, and a
source checkout of tyingspec, import as they do in the parent), and only then does it import
this module and call :func:`main`, which reads what to load from the parent and hands over to
the worker's loop.  Nothing imports the parent's ``__main__``: a user's script needs no
``__main__`` guard.
"""

from __future__ import annotations

import faulthandler
import sys
from multiprocessing.connection import Connection


def main(conn_fd: str, tracker_fd: str) -> None:
    """Serve the parent on the connection ``conn_fd``, sharing its resource tracker
    ``tracker_fd`` (``-1``: none)."""
    faulthandler.enable()  # first: a crash as the worker imports is reported too
    if int(tracker_fd) >= 0:
        # The shared blocks both processes map are registered with the parent's tracker, as
        # in a spawned child: one of the worker's own would unlink the parent's input blocks
        # as "leaked" when the worker dies, under the next worker that needs them.
        from multiprocessing import resource_tracker

        resource_tracker._resource_tracker._fd = int(tracker_fd)  # type: ignore[attr-defined]
    conn = Connection(int(conn_fd))
    try:  # the parent trusts no frame from the worker, but the worker trusts its parent
        spec, kind, paths, argv = conn.recv()
    except EOFError:  # the parent is gone before it said what to load
        return
    sys.argv = list(argv)  # the parent's, as a spawned child had them

    from tyingspec._src.engine.isolation import _serve

    _serve(conn, spec, kind, tuple(paths))
