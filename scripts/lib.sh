# Helpers shared by scripts/demo.sh and scripts/test.sh (sourced, not run).

# Print a Python >= 3.12 (Django 6 needs it), or fail saying how to get one.
find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3 python3.13 python3.12 \
      "$HOME"/.pyenv/versions/3.13*/bin/python3 "$HOME"/.pyenv/versions/3.12*/bin/python3; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  echo "distlocks needs Python 3.12 or newer: install it, or set PYTHON=/path/to/python3.12" >&2
  return 1
}

# Create the virtualenv $VENV (default .venv) if needed and pip-install the
# given requirement arguments into it.
venv_install() {
  local venv="${VENV:-.venv}"
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
    rm -rf "$venv"
    "$(find_python)" -m venv "$venv"
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
