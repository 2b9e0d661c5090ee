"""Test support, in one place; test modules import from here (and from the app modules that
subprocesses launch), never from each other. `benchmarks/` uses `servers` too.

- `servers`: where the shared Redis and Postgres are (`REDIS_URL`, `POSTGRES_DSN`, `require`);
  throwaway `redis-server`s (`RedisProcess`, `redis_process`), a Redis Cluster (`redis_cluster`)
  and a PostgreSQL cluster (`postgres_cluster`); the uvicorn launcher (`UvicornProcess`) and an
  in-loop uvicorn (`serving`); `free_port`, `reachable`, `ping`, `wait_until`.
- `stores`: the store list (`BACKENDS`, `SHARED`), the factory (`make_backend`, `store_from_url`,
  `store_url`), and `Delegating`, the Backend wrapper every fault or recording proxy subclasses.
- `asgi`: the raw ASGI driver (`drive`), scope builder (`http_scope`), `Result`, `messages_of`,
  `read_body`.
- `problems`: `assert_problem(answer, problem_type)`.
- `charges`: POST /payments of the decision-table tests (`Payments`, `protect`, `post`, `rk`,
  `crash_first_request`).
- `pay`: POST /pay as raw ASGI for the store tests (`Payments` counting runs per key, timed `post`).
- `signing`: webhook signatures as a provider sends them (`sign_stripe`).
- `hostile`: the harness of the bad-input and isolation properties (`open_store`, `Recorder`,
  `contract_key`, `Charge`, `status_of`).
- `scorecard`: reliability scorecards, execution ledgers and the two storm drivers (`asgi_post`,
  `http_post`).
- `faultproxy`: byte-level TCP proxies that lose, delay or reset traffic (`FaultProxy` for HTTP,
  `StoreProxy` for RESP and the Postgres protocol).
"""
