"""The test files of the installed timm and transformers, from their source distributions (sdists), fetched
by pip into the ignored ``.cache/`` folder at set-up and unpacked there, never copied into the repository.

    python -m benchmarks.suite_sources transformers   # prints the folder holding its tests/, fetching if needed

``make hf-suite`` and ``make timm-tests`` call it; a second call finds the folder and fetches nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import tarfile
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "suites"


def sources(package: str, cache: Path = CACHE) -> Path:
    """The unpacked ``tests/`` of ``package`` at its installed version (fetched once): the folder above it."""
    version = importlib.metadata.version(package)
    root = cache / f"{package}-{version}"
    if (root / "tests").is_dir():
        return root
    sdists = cache / "sdists"
    sdist = sdists / f"{package}-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "--dest", str(sdists), f"{package}=={version}"], check=True)  # fmt: skip
    top = f"{package}-{version}/tests/"
    with tarfile.open(sdist) as tar:  # only the test files: the package itself is the installed one
        members = [m for m in tar.getmembers() if m.name.startswith(top) and m.isfile()]
        if not members:
            raise SystemExit(f"{sdist.name} ships no tests/ folder")
        for m in members:
            m.name = m.name[len(f"{package}-{version}/") :]
        tar.extractall(root, members=members, filter="data")
    return root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("package", choices=["timm", "transformers"])
    print(sources(p.parse_args(argv).package))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
