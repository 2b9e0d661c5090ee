"""`python -m examples.payments`: serve the payments example, or run its scripted selftest.

python -m examples.payments                                  # uvicorn on 127.0.0.1:8000, memory store
python -m examples.payments --backend redis://127.0.0.1:6379/0
python -m examples.payments --selftest                       # in-process scenario, prints what happened
"""

from __future__ import annotations

import argparse
import asyncio
import logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.payments", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="memory://", help="memory:// (default), redis://... or postgresql://...")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--selftest", action="store_true", help="run the scripted scenario in-process and exit")
    args = parser.parse_args(argv)

    if args.selftest:
        from .selftest import configure_logging, run

        configure_logging()
        return asyncio.run(run())

    import uvicorn

    from .app import create_app

    # The state machine's warnings (illegal transitions) show in the server's log.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s:  %(name)s: %(message)s")
    uvicorn.run(create_app(args.backend), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
