"""Print the files of every installed distribution that kvbank's image needs.

The node's image reuses the packages already installed in the test environment rather than
downloading them again (torch alone is gigabytes): this walks kvbank's requirements, with the
extras asked for, through the installed distributions' metadata, and prints one path per line,
relative to the site-packages folder, for `tar --files-from`. kvbank itself is left out: the
image installs it from its own wheel, built from the working tree.

    python closure.py EXTRA... > files      the files
    python closure.py --versions EXTRA...   one `name==version` line per distribution (a cache key)
"""

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(extras: list[str]) -> list[metadata.Distribution]:
    """kvbank's installed dependencies (with `extras`), transitively, each once."""
    found: dict[str, metadata.Distribution] = {}
    pending = [(req, set(extras)) for req in metadata.requires("kvbank") or []]
    while pending:
        text, wanted = pending.pop()
        requirement = Requirement(text)
        marker = requirement.marker
        if marker is not None and not any(
            marker.evaluate({"extra": extra}) for extra in (wanted or {""})
        ):
            continue
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"closure.py: {name} (needed by kvbank) is not installed here")
        found[name] = dist
        pending.extend((req, set(requirement.extras)) for req in dist.requires or [])
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
