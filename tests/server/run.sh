#!/usr/bin/env bash
# The server's end-to-end tests: the official `openai` and `anthropic` clients (PyPI) against
# `moeflux serve` on 127.0.0.1. Needs the `moeflux` binary (default
# target/debug/moeflux, as `cargo test --workspace` builds it; set
# MOEFLUX_BIN to use another) and python3. The packages of
# requirements.txt are installed once into a virtual environment, target/py-serve-venv;
# with MOEFLUX_BROWSER_TESTS=1 (tests/server/browser.sh) those of
# requirements-browser.txt (Playwright) too. Arguments go to pytest
# (`-m "not browser"`: without the chat-page tests).
set -euo pipefail
cd "$(dirname "$0")/../.."

bin=${MOEFLUX_BIN:-target/debug/moeflux}
if [[ ! -x $bin ]]; then
  cargo build --locked -p moeflux-cli
fi
export MOEFLUX_BIN=$PWD/$bin

venv=target/py-serve-venv
# Installs one requirements file into the environment unless its stamp
# says it is there already.
install() {
  local req=$1 stamp=$venv/.$(basename "$1")
  if cmp -s "$req" "$stamp" 2>/dev/null; then
    return
  fi
  if [[ -x $venv/bin/python ]]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
  else
    # No venv module (a bare Debian python3): a --target directory.
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
      --target "$venv/site" -r "$req"
  fi
  cp "$req" "$stamp"
}
if ! cmp -s tests/server/requirements.txt "$venv/.requirements.txt" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv" || rm -rf "$venv"
  mkdir -p "$venv"
fi
install tests/server/requirements.txt
if [[ ${MOEFLUX_BROWSER_TESTS:-} == 1 ]]; then
  install tests/server/requirements-browser.txt
fi
if [[ -x $venv/bin/python ]]; then
  py=$venv/bin/python
else
  py=python3
  export PYTHONPATH="$PWD/$venv/site${PYTHONPATH:+:$PYTHONPATH}"
fi
PYTHONDONTWRITEBYTECODE=1 "$py" -m pytest -q -p no:cacheprovider tests/server "$@"
