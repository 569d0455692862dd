#!/bin/sh
# Headless Chromium for the viewer's browser tests (tests/e2e/test_viewer.py), from the Debian
# packages: part of the README's test command and of .ci/run. Does nothing if a chromium is on
# PATH; without root (and no sudo) it says so, and those tests skip with that reason.
set -e
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  run=""
elif command -v sudo >/dev/null 2>&1; then
  run="sudo"
else
  echo "install-browser: no chromium and no root: the viewer's browser tests will skip (apt-get install chromium)" >&2
  exit 0
fi
$run apt-get update -qq
DEBIAN_FRONTEND=noninteractive $run apt-get install -y -qq chromium >/dev/null
chromium --version
