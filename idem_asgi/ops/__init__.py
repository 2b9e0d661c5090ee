"""The operator's tools: the `idem-asgi` command line and `reconcile`."""
