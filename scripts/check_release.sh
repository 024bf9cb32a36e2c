#!/usr/bin/env bash
# The release as a stranger gets it: build the sdist, then the wheel from that sdist (so the sdist
# must carry all the wheel needs), check the wheel installs `cleave` and nothing else at top level,
# install it into a fresh venv outside the checkout and run there, from outside the checkout,
# `cleave --version`, a short `cleave train --local` and docs/api.md's example.
# Needs .venv (scripts/setup.sh): its python builds, and the fresh venv gets exactly its torch (the
# CPU pin of setup.sh), so pip never fetches another (a plain latest torch is a multi-GB CUDA download).
# PYTHON picks the fresh venv's interpreter, as in setup.sh. --lowest installs the lowest versions
# pyproject.toml's [project] dependencies allow (torch still .venv's), to check those floors hold.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py="$root/.venv/bin/python"
limit=300 # seconds each run may take: a job whose clients never join waits forever

fail() {
    echo "check_release: $*" >&2
    exit 1
}
case "${1:-}" in
"") lowest=0 ;;
--lowest) lowest=1 ;;
*) fail "unknown argument '$1' (usage: scripts/check_release.sh [--lowest])" ;;
esac
[ -x "$py" ] || fail "no .venv here: run bash scripts/setup.sh first"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cleave-release.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
log="$tmp/log"

# step WHAT CMD...: runs CMD with its output in $log, shown only when it fails.
step() {
    local what=$1 code=0
    shift
    "$@" >"$log" 2>&1 || code=$?
    if [ "$code" -eq 124 ]; then
        tail -n 40 "$log" >&2
        fail "$what took over $limit s (its last lines are above)"
    elif [ "$code" -ne 0 ]; then
        tail -n 40 "$log" >&2
        fail "$what failed (exit $code; its last lines are above)"
    fi
}
took() { echo "check_release: $1 ($((SECONDS - t0)) s)"; }

SECONDS=0
t0=$SECONDS
# With no --sdist or --wheel, build makes the sdist, then the wheel from the unpacked sdist.
step "building the sdist and the wheel from it" "$py" -m build --outdir "$tmp/dist" "$root"
sdists=("$tmp"/dist/cleave-*.tar.gz)
wheels=("$tmp"/dist/cleave-*.whl)
[ "${#sdists[@]}" -eq 1 ] && [ -f "${sdists[0]}" ] || fail "build made no single sdist: $(ls "$tmp/dist")"
[ "${#wheels[@]}" -eq 1 ] && [ -f "${wheels[0]}" ] || fail "build made no single wheel: $(ls "$tmp/dist")"
wheel=${wheels[0]}
version=$(basename "$wheel" | cut -d- -f2)

# The wheel holds `cleave` alone at top level, and every module and package-data file of the
# folders pyproject.toml maps onto it (what an sdist without them would silently drop).
"$py" - "$wheel" "$root/pyproject.toml" <<'EOF' || fail "the wheel $(basename "$wheel") is not what pyproject.toml describes"
import sys
import zipfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

wheel, pyproject = sys.argv[1], Path(sys.argv[2])
names = set(zipfile.ZipFile(wheel).namelist())
tops = {n.split("/")[0] for n in names}
info = {t for t in tops if t.endswith(".dist-info")}
if tops - info != {"cleave"} or len(info) != 1:
    sys.exit(f"its top-level names are {sorted(tops)}, not cleave and its .dist-info")
top_level = f"{info.pop()}/top_level.txt"
if top_level in names and zipfile.ZipFile(wheel).read(top_level).decode().split() != ["cleave"]:
    sys.exit("the wheel's top_level.txt is not just cleave")
tool = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["setuptools"]
dirs, data = tool["package-dir"], tool.get("package-data", {})
want = set()
for package in tool["packages"]:
    base = max((d for d in dirs if package == d or package.startswith(d + ".")), key=len)
    folder = pyproject.parent / dirs[base] / package[len(base) + 1 :].replace(".", "/")
    files = [*folder.glob("*.py"), *(f for pattern in data.get(package, []) for f in folder.glob(pattern))]
    want |= {f"{package.replace('.', '/')}/{f.relative_to(folder).as_posix()}" for f in files if f.is_file()}
if missing := sorted(want - names):
    sys.exit(f"it lacks {len(missing)} files of the source tree, first {missing[:5]}")
EOF
took "built $(basename "${sdists[0]}") and, from it, $(basename "$wheel")"

t0=$SECONDS
torch_version=$("$py" -c 'from importlib.metadata import version; print(version("torch"))')
echo "torch==$torch_version" >"$tmp/constraints.txt"
if [ "$lowest" -eq 1 ]; then
    "$py" - "$root/pyproject.toml" >>"$tmp/constraints.txt" <<'EOF' || fail "could not read pyproject.toml's floors"
import sys
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

for line in tomllib.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))["project"]["dependencies"]:
    req = Requirement(line)
    floors = [s.version for s in req.specifier if s.operator == ">="]
    if req.name != "torch" and floors and (req.marker is None or req.marker.evaluate()):
        print(f"{req.name}=={floors[0]}")
EOF
fi
venv="$tmp/venv"
# The interpreter .venv was made from: the torch wheel's Python tag must fit it.
base=$("$py" -c 'import sys; print(sys._base_executable)')
step "making a fresh venv" "$base" -m venv "$venv"
# A CPU build (torch==X+cpu) lies on PyTorch's CPU index, not on PyPI: that index is asked only
# when the configured ones (here a local wheel folder) do not have it.
install=("$venv/bin/python" -m pip install --quiet --constraint "$tmp/constraints.txt" "$wheel")
if ! "${install[@]}" >"$log" 2>&1; then
    case "$torch_version" in
    *+cpu) step "installing the wheel (torch==$torch_version, from PyTorch's CPU index)" \
        "${install[@]}" --extra-index-url https://download.pytorch.org/whl/cpu ;;
    *) tail -n 40 "$log" >&2 && fail "installing the wheel (torch==$torch_version) failed (its last lines are above)" ;;
    esac
fi
took "installed the wheel into a fresh venv with $(paste -sd ' ' "$tmp/constraints.txt")"

# From outside the checkout, so only the installed package can be imported.
t0=$SECONDS
mkdir "$tmp/run"
cd "$tmp/run"
unset PYTHONPATH
where=$("$venv/bin/python" -c 'import cleave; print(cleave.__file__)') || fail "import cleave failed in the fresh venv"
case $where in
"$venv"/*) ;;
*) fail "import cleave found $where, not the installed wheel" ;;
esac
got=$("$venv/bin/cleave" --version) || fail "cleave --version failed"
[ "$got" = "cleave $version" ] || fail "cleave --version said '$got', not 'cleave $version'"
step "cleave train --local --steps 3" timeout "$limit" "$venv/bin/cleave" train --local --steps 3
grep -q "^done: 3 steps" "$log" || fail "cleave train --local did not report 3 steps done"
# docs/api.md's example as the doc has it (every python block under "## Example"), then the
# doc's claim that its two runs agree.
"$py" - "$root/docs/api.md" >example.py <<'EOF' || fail "docs/api.md has no python code under ## Example"
import re
import sys
from pathlib import Path

doc = Path(sys.argv[1]).read_text(encoding="utf-8")
section = re.search(r"^## Example\n(.*?)(?=^## |\Z)", doc, re.S | re.M)
blocks = re.findall(r"^```python\n(.*?)^```", section.group(1) if section else "", re.S | re.M)
if not blocks:
    sys.exit(1)
print("\n".join(blocks))
EOF
cat >>example.py <<'EOF'
# check_release.sh: both runs took every step, with the same losses
assert len(outcome.results) == len(local) == train.steps, (len(outcome.results), len(local))
assert all(abs(a.loss - b.loss) <= 1e-4 * abs(b.loss) for a, b in zip(outcome.results, local)), "losses differ"
EOF
step "docs/api.md's example" timeout "$limit" "$venv/bin/python" example.py
took "ran cleave --version, cleave train --local and docs/api.md's example from the wheel"
echo "check_release: ok ($SECONDS s in all)"
