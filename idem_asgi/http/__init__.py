"""The ASGI adapter: the middleware, its routes and policies, keys, fingerprints, problem answers."""
