#!/usr/bin/env bash
# The services the tests, benchmarks and demo talk to, as this machine kind runs them: start the
# local Redis (6379), PostgreSQL (5432, trust auth, database `test`), RabbitMQ (5672, guest/guest)
# and NATS with JetStream (4222) unless they already answer.
# Safe to run repeatedly. (Throwaway servers a test kills or fails over are started by the tests
# themselves: tests/support/servers.py.)
set -euo pipefail

if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "start-services: starting redis-server on 127.0.0.1:6379"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 50); do redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi

if ! (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null && command -v rabbitmq-server >/dev/null; then
  echo "start-services: starting RabbitMQ on 127.0.0.1:5672"
  rabbitmq-server -detached
  for _ in $(seq 120); do (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null && break; sleep 0.5; done
fi

if ! (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null && command -v nats-server >/dev/null; then
  echo "start-services: starting NATS with JetStream on 127.0.0.1:4222"
  mkdir -p /var/lib/nats-server
  nohup nats-server -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log \
    >/dev/null 2>&1 &
  for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null && break; sleep 0.1; done
fi

if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  echo "start-services: starting PostgreSQL on 127.0.0.1:5432"
  version="$(ls /etc/postgresql | sort -V | tail -1)"
  pg_ctlcluster --skip-systemctl-redirect "$version" main start
  for _ in $(seq 100); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 0.1; done
fi
if ! psql -h 127.0.0.1 -U postgres -d test -Atc 'select 1' >/dev/null 2>&1; then
  psql -h 127.0.0.1 -U postgres -d postgres -c 'CREATE DATABASE test' >/dev/null
fi
