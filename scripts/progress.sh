# Sourced by the set-up scripts: long steps say what they do, and keep saying it.
#   step PREFIX "what (expected time)" command args...
# prints "PREFIX: what (expected time)" on stderr, then "PREFIX:   what: still at it (N s)" every
# PROGRESS_EVERY_S seconds (default 20) while the command runs, then how long it took; the
# command's exit status is the step's. A CI log or a piped `make test` never sits silent for
# minutes (issue #47: the SGLang CPU env build said nothing for 194 s).

PROGRESS_EVERY_S="${PROGRESS_EVERY_S:-20}"

step() {
  local prefix="$1" what="$2"
  shift 2
  local started=$SECONDS last=$SECONDS status=0
  echo "$prefix: $what" >&2
  "$@" &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 0.2
    if kill -0 "$pid" 2>/dev/null && (( SECONDS - last >= PROGRESS_EVERY_S )); then
      echo "$prefix:   ${what%% (*}: still at it ($((SECONDS - started)) s)" >&2
      last=$SECONDS
    fi
  done
  wait "$pid" || status=$?
  if (( status == 0 )); then
    echo "$prefix:   done in $((SECONDS - started)) s" >&2
  else
    echo "$prefix:   failed (exit $status) after $((SECONDS - started)) s" >&2
  fi
  return "$status"
}
