#!/usr/bin/env bash
# Sourced by the scripts that build a reference or sidecar venv (build_vllm_venv.sh,
# build_verl_venv.sh, build_trl_venv.sh). It defines one function:
#
#   cached_venv NAME CHECK STEP...
#
# which prints the python of a venv that holds exactly the pinned packages of the STEPs, building
# it first when it is missing. Each STEP is one `pip install` argument string (word-split, so
# "torch==2.13.0" or "-c FILE pkg==1.0 other==2"); a STEP starting with "uninstall:" uninstalls
# the packages after it instead. CHECK is Python code that must run in the finished venv (an
# import of what it is for); it also prints the versions into the build log.
#
# The venv lives under ${GRPO_JAX_CACHE:-~/.cache/grpo_jax}/NAME-venv-<stamp>, where <stamp>
# hashes the STEPs, so a fresh clone reuses it and a change of pins builds a new one. It is built
# in a temporary directory and renamed into place only after CHECK passes, so a half-built venv is
# never found. A lock serialises concurrent builds of the same NAME. On failure the function
# prints the log's tail on stderr and returns non-zero.
cached_venv() {
  local name="$1" check="$2"
  shift 2
  local stamp_text="$* | r1"
  local stamp cache venv log
  stamp="$(printf '%s' "$stamp_text" | sha256sum | cut -c1-12)"
  cache="${GRPO_JAX_CACHE:-$HOME/.cache/grpo_jax}"
  venv="$cache/$name-venv-$stamp"
  log="$cache/$name-venv-$stamp.build.log"
  mkdir -p "$cache"

  _venv_ok() { [ -f "$1/.grpo_jax_stamp" ] && "$1/bin/python" -c "$check" >/dev/null 2>&1; }
  if _venv_ok "$venv"; then
    echo "$venv/bin/python"
    return 0
  fi
  exec 9>"$cache/$name-venv.lock"
  flock 9
  if _venv_ok "$venv"; then # another process built it while this one waited for the lock
    echo "$venv/bin/python"
    return 0
  fi

  echo "building the $name venv in $venv (log: $log)" >&2
  local tmp="$venv.tmp.$$" base="${GRPO_JAX_VENV_BASE_PYTHON:-python3}" ok=1 step
  rm -rf "$tmp"
  {
    "$base" -m venv "$tmp" || ok=0
    for step in "$@"; do
      [ "$ok" = 1 ] || break
      if [[ "$step" == uninstall:* ]]; then
        # shellcheck disable=SC2086 # word-splitting the package list is the point
        "$tmp/bin/python" -m pip uninstall -y -q ${step#uninstall:} || ok=0
      else
        # shellcheck disable=SC2086
        "$tmp/bin/python" -m pip install --no-input -q $step || ok=0
      fi
    done
    [ "$ok" = 1 ] && { "$tmp/bin/python" -c "$check" || ok=0; }
  } >"$log" 2>&1
  if [ "$ok" != 1 ]; then
    rm -rf "$tmp"
    echo "building the $name venv failed; see $log" >&2
    tail -n 20 "$log" >&2
    return 1
  fi
  printf '%s\n' "$stamp_text" >"$tmp/.grpo_jax_stamp"
  # Absolute paths inside a venv (bin/ scripts, pyvenv.cfg) name the build directory; point them
  # at the final one so the renamed venv is fully usable.
  grep -rlF "$tmp" "$tmp/bin" 2>/dev/null | xargs -r sed -i "s|$tmp|$venv|g"
  rm -rf "$venv"
  mv "$tmp" "$venv"
  echo "$venv/bin/python"
}
