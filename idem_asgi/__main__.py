"""`python -m idem_asgi ...` runs the `idem-asgi` command line (see `idem_asgi.cli`)."""

from .cli import main

raise SystemExit(main())
