# Helpers shared by scripts/demo.sh and scripts/test.sh (sourced, not run).

# Print the newest Python whose version lies between $1 and $2 (default: 3.10
# and newer; Django 6 needs 3.12, Django 5.2 runs on 3.10), looking at $PYTHON
# first, then the PATH and pyenv's versions; or fail saying how to get one.
find_python() {
  local lowest="${1:-3.10}" highest="${2:-3.99}" candidate version best="" best_key=0
  for candidate in "${PYTHON:-}" python3 python3.14 python3.13 python3.12 python3.11 python3.10 \
      "$HOME"/.pyenv/versions/3.*/bin/python3; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
    version=$("$candidate" -c 'import sys; print("%d %d" % sys.version_info[:2])' 2>/dev/null) || continue
    python_in_range "$version" "$lowest" "$highest" || continue
    if [ -n "${PYTHON:-}" ] && [ "$candidate" = "$PYTHON" ]; then
      command -v "$candidate"
      return 0
    fi
    local key=$(( ${version% *} * 100 + ${version#* } ))
    if [ "$key" -gt "$best_key" ]; then
      best=$(command -v "$candidate")
      best_key=$key
    fi
  done
  if [ -n "$best" ]; then
    echo "$best"
    return 0
  fi
  echo "distlocks needs a Python from $lowest to $highest here: install one (e.g. pyenv install $lowest), or set PYTHON=/path/to/python$lowest" >&2
  return 1
}

# True if "MAJOR MINOR" ($1) lies between the dotted versions $2 and $3.
python_in_range() {
  local key=$(( ${1% *} * 100 + ${1#* } ))
  local low=$(( ${2%.*} * 100 + ${2#*.} )) high=$(( ${3%.*} * 100 + ${3#*.} ))
  [ "$key" -ge "$low" ] && [ "$key" -le "$high" ]
}

# Create the virtualenv $VENV (default .venv) on a Python between $PYTHON_LOWEST
# and $PYTHON_HIGHEST (default 3.10 and newer) if it has none, and pip-install
# the given requirement arguments into it.
venv_install() {
  local venv="${VENV:-.venv}" lowest="${PYTHON_LOWEST:-3.10}" highest="${PYTHON_HIGHEST:-3.99}" version
  version=$("$venv/bin/python" -c 'import sys; print("%d %d" % sys.version_info[:2])' 2>/dev/null) || version="0 0"
  if ! python_in_range "$version" "$lowest" "$highest"; then
    rm -rf "$venv"
    "$(find_python "$lowest" "$highest")" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
  fi
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}

# Install Debian packages that are missing (as root, or through sudo).
apt_ensure() {
  local missing=() package
  for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "Installing Debian packages: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

# Wait up to 60 s for a command to succeed.
wait_for() {
  local deadline=$((SECONDS + 60))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || { echo "timed out waiting for: $*" >&2; return 1; }
    sleep 0.5
  done
}

# Start MariaDB and PostgreSQL on loopback unless they already answer.
ensure_databases() {
  if ! mysqladmin --protocol=tcp -h 127.0.0.1 -uroot ping >/dev/null 2>&1; then
    echo "Starting MariaDB"
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
    wait_for mysqladmin --protocol=tcp -h 127.0.0.1 -uroot ping
  fi
  if ! pg_isready -q -h 127.0.0.1; then
    echo "Starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n 1)" main start
    wait_for pg_isready -q -h 127.0.0.1
  fi
}

# Build the docs site (mkdocs.yml) into a temporary directory with --strict: a
# broken link or reference, or a page missing from the nav, fails. Then fail if
# a built page loads a script, a style sheet, a font or an image from another
# host: the site must work without a network.
build_docs() {
  local site status=0
  site=$(mktemp -d)
  NO_MKDOCS_2_WARNING=1 "${VENV:-.venv}/bin/mkdocs" build --strict --quiet --site-dir "$site" || status=$?
  if [ $status -eq 0 ] && grep -rEl '<(script|link|img|source)[^>]* (src|href)="(https?:)?//' "$site" --include='*.html'; then
    echo "these pages load something from another host (above): vendor it or drop it" >&2
    status=1
  fi
  rm -rf "$site"
  return $status
}

# Run a command and note how long it took, for print_times.
STEP_TIMES=()
timed() {
  local started=$SECONDS status=0
  "$@" || status=$?
  STEP_TIMES+=("$((SECONDS - started)) s	$*")
  return $status
}

# The time of every step run through timed, and of the whole script.
print_times() {
  echo "Steps (wall time):"
  printf '  %s\n' "${STEP_TIMES[@]}" | cut -c1-100
  echo "  $SECONDS s	in all"
}

# Run a command ($2...) showing its output and keeping it in the file $1.
pass_log() {
  local log="$1"
  shift
  "$@" 2>&1 | tee "$log"
}
