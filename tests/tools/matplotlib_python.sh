# Sourced by the tools' tests: sets $python to a python3 that imports matplotlib, or
# exits 77 (ctest: skipped) naming the test. Debian's python3-matplotlib is installed
# for /usr/bin/python3; a python3 earlier on PATH (pyenv, a venv) may not see it.
#   source matplotlib_python.sh NAME
python=""
for candidate in python3 /usr/bin/python3; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import matplotlib' >/dev/null 2>&1; then
    python="$candidate"
    break
  fi
done
if [[ -z "$python" ]]; then
  echo "$1: skipped: no python3 imports matplotlib (Debian: apt-get install python3-matplotlib)"
  exit 77
fi
