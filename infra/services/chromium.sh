#!/usr/bin/env bash
# Debian's Chromium for the browser tests, which drive it with Playwright (Playwright's own
# browser download is never used).
#
#   chromium.sh install               install Debian's chromium package when /usr/bin/chromium is missing
set -euo pipefail

CHROMIUM=/usr/bin/chromium

die() { echo "chromium.sh: $*" >&2; exit 1; }

is_root() { [ "$(id -u)" = 0 ]; }

install() {
  if [ -x "$CHROMIUM" ]; then return 0; fi
  is_root || die "Chromium is not installed; as root run: $0 install"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q chromium || die "apt-get install chromium failed"
  [ -x "$CHROMIUM" ] || die "chromium is installed but $CHROMIUM was not found"
}

case "${1:-}" in
  install) install ;;
  *) die "usage: $0 install" ;;
esac
