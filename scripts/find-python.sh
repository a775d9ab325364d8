#!/usr/bin/env bash
# Print the path of a Python >= 3.12 interpreter: PATH first, then pyenv's versions
# (`pyenv root`, $PYENV_ROOT, ~/.pyenv). Exit 1 with a clear message if there is none.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
candidates=()
for name in python3.14 python3.13 python3.12 python3 python; do
    p=$(command -v "$name" 2>/dev/null) && candidates+=("$p")
done
roots=()
command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root 2>/dev/null)")
roots+=("${PYENV_ROOT:-}" "$HOME/.pyenv")
for root in "${roots[@]}"; do
    [ -n "$root" ] && [ -d "$root/versions" ] || continue
    for p in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV); do candidates+=("$p"); done
done
for p in "${candidates[@]}"; do
    if ok "$p"; then echo "$p"; exit 0; fi
done
echo "error: no Python >= 3.12 found on PATH or under pyenv (looked in: ${roots[*]}); install one, e.g. 'pyenv install 3.12'" >&2
exit 1
