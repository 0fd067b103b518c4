#!/usr/bin/env bash
# The server's end-to-end tests: the official `openai` and `anthropic` clients (PyPI) against
# `moeflux serve` on 127.0.0.1. Needs the `moeflux` binary (default
# target/debug/moeflux, as `cargo test --workspace` builds it; set
# MOEFLUX_BIN to use another) and python3. The packages of
# requirements.txt are installed once into a virtual environment, target/py-serve-venv.
set -euo pipefail
cd "$(dirname "$0")/../.."

bin=${MOEFLUX_BIN:-target/debug/moeflux}
if [[ ! -x $bin ]]; then
  cargo build --locked -p moeflux-cli
fi
export MOEFLUX_BIN=$PWD/$bin

venv=target/py-serve-venv
stamp=$venv/.requirements
if ! cmp -s tests/server/requirements.txt "$stamp" 2>/dev/null; then
  rm -rf "$venv"
  if python3 -m venv "$venv"; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      -r tests/server/requirements.txt
  else
    # No venv module (a bare Debian python3): a --target directory.
    rm -rf "$venv"
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
      --target "$venv/site" -r tests/server/requirements.txt
  fi
  cp tests/server/requirements.txt "$stamp"
fi
if [[ -x $venv/bin/python ]]; then
  py=$venv/bin/python
else
  py=python3
  export PYTHONPATH="$PWD/$venv/site${PYTHONPATH:+:$PYTHONPATH}"
fi
PYTHONDONTWRITEBYTECODE=1 "$py" -m pytest -q -p no:cacheprovider tests/server "$@"
