"""Fetch the pinned ggml sources into vendor/ggml/ (run by CMake at configure time).

Usage: python fetch_ggml.py REPO_ROOT
Prints the absolute path of the ggml source tree on its last line of stdout.
Exit status 1 with a message on stderr when the sources cannot be had or fail the hash check.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


def fail(message: str) -> None:
    print(f"pyggml: {message}", file=sys.stderr)
    sys.exit(1)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(pin: dict, into: Path) -> Path:
    local = os.environ.get("PYGGML_GGML_SDIST")
    if local:
        return Path(local)
    spec = f"{pin['package']}=={pin['version']}"
    # --no-build-isolation: pip would otherwise set up a build env just to read the sdist's metadata.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "--disable-pip-version-check", "-q", spec, "-d", str(into)]
    print(f"pyggml: downloading {spec} for the ggml sources", file=sys.stderr)
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = into / pin["filename"]
    if not path.exists():
        fail(f"could not download {spec} (needed for the ggml sources):\n{result.stdout}\n"
             "Set PYGGML_GGML_SDIST to a local copy of the sdist, or PYGGML_GGML_SOURCE to a ggml tree.")
    return path


def extract(archive: Path, pin: dict, dest: Path) -> None:
    prefix = f"{pin['filename'].removesuffix('.tar.gz')}/"
    subdir = prefix + pin["subdir"].rstrip("/") + "/"
    license_name = prefix + pin["license"]
    staging = Path(tempfile.mkdtemp(prefix="ggml-", dir=dest.parent))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar.getmembers():
                if member.name == license_name:
                    member.name = "LICENSE"
                elif member.name.startswith(subdir) and member.name != subdir:
                    member.name = "ggml/" + member.name[len(subdir):]
                else:
                    continue
                if not (member.isfile() or member.isdir()):
                    continue
                tar.extract(member, staging, filter="data")
        if not (staging / "ggml" / "CMakeLists.txt").exists():
            fail(f"{archive.name} has no {pin['subdir']}/CMakeLists.txt: is the pin right?")
        shutil.rmtree(dest / "ggml", ignore_errors=True)
        (staging / "ggml").rename(dest / "ggml")
        if (staging / "LICENSE").exists():
            os.replace(staging / "LICENSE", dest / "LICENSE")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main() -> None:
    root = Path(sys.argv[1]).resolve()
    override = os.environ.get("PYGGML_GGML_SOURCE")
    if override:
        tree = Path(override).resolve()
        if not (tree / "CMakeLists.txt").exists() or not (tree / "include" / "ggml.h").exists():
            fail(f"PYGGML_GGML_SOURCE={override} is not a ggml tree (needs CMakeLists.txt and include/ggml.h)")
        print(tree)
        return

    vendor = root / "vendor" / "ggml"
    pin = json.loads((vendor / "pin.json").read_text())
    stamp = vendor / "ggml" / ".pyggml-stamp"
    if stamp.exists() and stamp.read_text().strip() == pin["sha256"]:
        print(vendor / "ggml")
        return

    with tempfile.TemporaryDirectory(prefix="pyggml-sdist-") as tmp:
        archive = download(pin, Path(tmp))
        actual = sha256_of(archive)
        if actual != pin["sha256"]:
            fail(f"sha256 mismatch for {archive.name}: expected {pin['sha256']}, got {actual}. "
                 "Refusing to build from unverified sources.")
        extract(archive, pin, vendor)
    stamp.write_text(pin["sha256"] + "\n")
    print(vendor / "ggml")


if __name__ == "__main__":
    main()
