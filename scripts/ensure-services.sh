#!/usr/bin/env bash
# Start each service the tests need when it does not answer: Redis, PostgreSQL, MariaDB,
# RabbitMQ.
# Installs a missing server from Debian's packages first. Safe to run again and again.
set -u

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() {  # name port [half-seconds]
  for _ in $(seq 1 "${3:-60}"); do answers "$2" && return 0; sleep 0.5; done
  echo "ensure-services: $1 still not answering on port $2" >&2
  return 1
}

apt_updated=""
install() {  # debian packages...
  if [ -z "$apt_updated" ]; then apt-get update -qq >/dev/null 2>&1; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1
}

status=0
if ! answers 6379; then
  command -v redis-server >/dev/null || install redis-server
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
  wait_for Redis 6379 || status=1
fi
if ! answers 5432; then
  [ -d /etc/postgresql ] || install postgresql
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start
  wait_for PostgreSQL 5432 || status=1
fi
if ! answers 3306; then
  [ -x /usr/sbin/mariadbd ] || install mariadb-server
  mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld 2>/dev/null
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
  wait_for MariaDB 3306 || status=1
fi
if ! answers 5672; then
  command -v rabbitmq-server >/dev/null || install rabbitmq-server
  rabbitmq-server -detached >/dev/null 2>&1
  wait_for RabbitMQ 5672 240 || status=1  # an Erlang node takes a while to boot
fi
exit $status
