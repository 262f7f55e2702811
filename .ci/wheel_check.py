"""Check a built wheel from outside the checkout: `python .ci/wheel_check.py dist/vispos-*.whl README.md`.

Run with the interpreter of a clean environment the wheel was installed into (`make wheel-check`): the
wheel holds the `vispos` package only (no `train`, no `benchmarks`), declares its license as an SPDX
expression and one console script; the installed package is the wheel's, not the checkout; and README's
Quick start (the Python block under its "## Quick start" heading) runs there.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import zipfile
from pathlib import Path


def check_contents(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    tops = sorted({n.split("/")[0] for n in names} - {dist_info})
    if tops != ["vispos"]:
        sys.exit(f"{wheel.name} holds {tops}; expected the vispos package only")
    meta = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    if "License-Expression: MIT" not in meta:
        sys.exit(f"{wheel.name}: METADATA has no 'License-Expression: MIT'")
    scripts = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    if re.findall(r"^(\S+) = ", scripts, flags=re.M) != ["vispos"]:
        sys.exit(f"{wheel.name}: console scripts {scripts!r}; expected vispos only")
    print(f"{wheel.name}: {len(names)} files, top level: vispos/ and {dist_info}/; License-Expression: MIT")


def quick_start(readme: str) -> str:
    """The code of README's Quick start: the first Python block of its "## Quick start" section."""
    sections = re.split(r"^## ", readme, flags=re.M)
    section = next((s for s in sections if s.startswith("Quick start\n")), None)
    blocks = re.findall(r"```python\n(.*?)```", section or "", flags=re.S)
    if not blocks:
        sys.exit('README has no Python block under a "## Quick start" heading')
    return blocks[0]


def check_installed(readme: Path) -> None:
    for name in ("train", "benchmarks"):
        if importlib.util.find_spec(name) is not None:
            sys.exit(f"the environment can import {name!r}; the wheel must install vispos only")
    import vispos

    where = Path(vispos.__file__).resolve()
    if Path(sys.prefix).resolve() not in where.parents:
        sys.exit(f"vispos was imported from {where}, not from the wheel installed in {sys.prefix}")
    code = quick_start(readme.read_text())
    exec(compile(code, f"{readme} quick start", "exec"), {"__name__": "__quick_start__"})
    print(f"README quick start ran with vispos {vispos.__version__} from {where.parent}")


if __name__ == "__main__":
    check_contents(Path(sys.argv[1]))
    check_installed(Path(sys.argv[2]))
