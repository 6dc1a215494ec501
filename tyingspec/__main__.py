"""``python -m tyingspec``: the ``tyingspec`` command, for an environment whose scripts are not
on ``PATH``."""

from tyingspec._src.front.entry import main

raise SystemExit(main())
