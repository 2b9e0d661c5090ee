"""`python -m idem_asgi ...` runs the `idem-asgi` command line (see `idem_asgi.ops.cli`)."""

from .ops.cli import main

raise SystemExit(main())
