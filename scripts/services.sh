#!/usr/bin/env bash
# Services the tests start themselves: make sure their programs are installed (only what is missing).
# PostgreSQL: tests/conftest.py runs a throwaway server (ckptstore/testing/postgres_server.py) with
# initdb and pg_ctl, found on PATH or in /usr/lib/postgresql/*/bin.
set -euo pipefail
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "installing PostgreSQL for the tests (apt-get install -y postgresql)" >&2
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
  else
    echo "the tests need PostgreSQL's initdb and pg_ctl: install PostgreSQL and put its bin folder on PATH" >&2
    exit 1
  fi
fi
