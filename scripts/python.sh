# Sourced by the scripts here (from the repository root): PYTHON, the interpreter lazyblock is
# installed for. $PYTHON if set; else the repository's .venv if there is one, or if python3
# is the system's own and externally managed (Debian 12's on a fresh machine: pip refuses to
# install into it), in which case scripts/install-deps makes the .venv; else python3.
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ -x .venv/bin/python ] || python3 -c 'import os, sys, sysconfig
sys.exit(not (sys.prefix == sys.base_prefix and os.path.exists(
    os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))))' 2>/dev/null; then
    PYTHON=$PWD/.venv/bin/python
  fi
fi
