"""Print a constraints file without torch and the packages the installed torch requires.

For `TORCH_SPEC=... make run` on a GPU machine (scripts/bootstrap.sh): the torch named there
(a CUDA build) pins its own dependencies (nvidia-*, triton), which must win over the pins made
beside the CPU build. Run with the venv's python; usage: constraints_without_torch.py FILE"""
from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, requires


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.split(r"[\s;<>=!~\[(@]", requirement.strip(), maxsplit=1)[0])


def main(path: str) -> None:
    try:
        owned = {requirement_name(r) for r in requires("torch") or []
                 if not re.search(r"\bextra\s*==", r)}  # an extra's needs are not torch's
    except PackageNotFoundError:
        owned = set()
    owned.add("torch")
    for line in open(path, encoding="utf-8"):
        pin = line.split("#", 1)[0].strip()
        if pin and requirement_name(pin) in owned:
            continue
        sys.stdout.write(line)


if __name__ == "__main__":
    main(sys.argv[1])
