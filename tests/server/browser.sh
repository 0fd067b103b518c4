#!/usr/bin/env bash
# The chat page in a real browser (test_chat_page.py): Playwright from PyPI
# driving Chromium from Debian's packages. Playwright's own browser download
# is never used (`playwright install` fetches from a CDN that CI cannot
# reach). Chromium is installed with apt-get when it is missing and this is
# root on a system with apt-get (a failed install fails); otherwise the tests
# are skipped with a note.
# Bounded: $BROWSER_TEST_SECONDS (default 300) for the whole run.
set -euo pipefail
cd "$(dirname "$0")/../.."

export CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
if [[ ! -x $CHROMIUM ]]; then
  if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
    if ! { apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; then
      # Root with apt-get (CI): a failed install fails the run rather than
      # passing without the browser tests.
      echo "error: apt-get could not install chromium for the chat page's browser tests" >&2
      exit 1
    fi
  else
    echo "note: no Chromium at $CHROMIUM and no apt-get as root to install it; the chat page was not tested in a browser"
    exit 0
  fi
fi
MOEFLUX_BROWSER_TESTS=1 exec timeout "${BROWSER_TEST_SECONDS:-300}" tests/server/run.sh -m browser "$@"
