#!/usr/bin/env bash
# Moves the pins of constraints/ddtree-ops.txt on purpose (what `make run`, `make test` and CI
# install; scripts/bootstrap.sh): installs `ddtree-ops[test]` from this checkout the way a user
# installs it (not editable, `pip install --upgrade`: the newest versions pyproject.toml allows)
# into a throwaway venv beside the pinned CPU torch, runs the terminal suite (tests/terminal)
# with that venv, and only if it passes writes what was installed as the new pins.
# One command; rerun it whenever pyproject.toml's dependencies change (a merge that adds one),
# then commit the file:
#   bash scripts/refresh_constraints.sh             # resolve, test, write
#   bash scripts/refresh_constraints.sh --check     # resolve and test only: does the newest still pass?
#   bash scripts/refresh_constraints.sh --no-tests  # resolve and write, untested (say so in the commit)
# Arguments after the mode go to pytest.
# About 2 min to build the venv (torch's 200 MB wheel included) and 3-5 min for the suite on 2
# idle cores. TORCH_SPEC as for bootstrap.sh (default torch==2.13.0, the CPU build); the pins
# leave torch itself to it. The venv is removed afterwards unless KEEP_VENV=1.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/progress.sh

mode="${1:-write}"
case "$mode" in write|--check|--no-tests) ;; *) echo "usage: $0 [--check|--no-tests] [PYTEST ARGS...]" >&2; exit 2 ;; esac
shift || true  # what follows goes to pytest (e.g. -k 'not fleet')
OUT=constraints/ddtree-ops.txt
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
say=refresh-constraints
work="$(mktemp -d "${TMPDIR:-/tmp}/ddtree-ops-newest.XXXXXX")"
[ "${KEEP_VENV:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
venv="$work/venv"
pip_() { "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

mapfile -t build_requires < <(python3 -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")')
make_venv() { python3 -m venv "$venv" && pip_ --upgrade pip "${build_requires[@]}"; }
step "$say" "[1/4] throwaway venv $venv with the newest pip and ${build_requires[*]} (seconds)" make_venv
step "$say" "[2/4] $TORCH_SPEC, as bootstrap.sh installs it (about 1 min)" pip_ "$TORCH_SPEC"
step "$say" "[3/4] ddtree-ops[test] from this checkout with --upgrade: the newest allowed versions (about 1 min)" \
  pip_ --upgrade ".[test]"

pins="$work/pins.txt"
"$venv/bin/python" -m pip freeze --all --disable-pip-version-check \
  | grep -v -i -E '^(ddtree-ops|ddtree_ops|torch)( @|==)' | grep -v ' @ ' | LC_ALL=C sort -f > "$pins"
if [ -f "$OUT" ]; then
  echo "$say: changes against $OUT (< pinned now, > newest allowed):" >&2
  diff <(grep -v '^#' "$OUT") "$pins" >&2 || true
fi

if [ "$mode" != --no-tests ]; then
  # -P: the test process imports the installed package, not this checkout's folder
  step "$say" "[4/4] the terminal suite (tests/terminal) with these versions (3-5 min)" \
    "$venv/bin/python" -P -m pytest -p no:cacheprovider -q tests/terminal "$@"
else
  echo "$say: [4/4] the terminal suite: skipped (--no-tests)" >&2
fi
[ "$mode" = --check ] && { echo "$say: the newest allowed versions pass; $OUT left as it is" >&2; exit 0; }

python_version="$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
platform="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_platform())')"
tested="the terminal suite passed on them"
[ "$mode" = --no-tests ] && tested="NOT tested (--no-tests)"
{
  echo "# What \`make run\`, \`make test\` and CI install beside torch (scripts/bootstrap.sh: pip install -c)."
  echo "# The exact versions pip chose for \`pip install --upgrade ddtree-ops[test]\` next to $TORCH_SPEC"
  echo "# (torch itself is TORCH_SPEC's) on $(date -u +%Y-%m-%d); $tested."
  echo "# Made by scripts/refresh_constraints.sh; do not edit by hand: rerun it (docs/dev/extending.md)."
  echo "# python: $python_version"
  echo "# platform: $platform"
  cat "$pins"
} > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "$say: wrote $OUT ($(grep -c -v '^#' "$OUT") pins); commit it" >&2
