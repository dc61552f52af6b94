"""The model dir and the `--include`s as one zip, built once per search: what travels to every node
of every trial (through Ray's object store, which sends it to each node once).

It leaves out what the local runner's copies leave out (caches, environments, the search's own
results), so a trial sees the same files on every runner.
"""

from __future__ import annotations

import io
import os
import stat
import tempfile
import zipfile
from pathlib import Path

from dsat.runners.local.runner import copy_ignore


def _add_tree(bundle: zipfile.ZipFile, root: Path, prefix: str, results_dir: Path) -> None:
    """``root``'s files under ``prefix``. A link to a folder is followed, as the local runner's
    copy follows it (``data -> /datasets/x``, the usual way to point at a dataset, was left out,
    and the trial failed on Ray alone), except back to a folder above it (``copy_ignore``)."""
    ignore = copy_ignore(results_dir)
    for directory, subdirs, names in os.walk(root, followlinks=True):
        ignored = ignore(directory, [*subdirs, *names])
        subdirs[:] = sorted(d for d in subdirs if d not in ignored)
        relative = Path(directory).relative_to(root)
        for name in sorted(names):
            if name in ignored:
                continue
            path = Path(directory) / name
            if path.is_file():
                bundle.write(path, str(Path(prefix) / relative / name))


def model_archive(model_dir: Path, includes: tuple[Path, ...], results_dir: Path) -> bytes:
    """The zip's bytes: MODEL_DIR's contents at the top, each include beside them by its name.
    Built in a temporary file, not in memory: a model dir of a few GB took three times that in
    the driver's memory (the buffer, and its copy as bytes)."""
    with tempfile.TemporaryFile() as spooled:
        with zipfile.ZipFile(spooled, "w", zipfile.ZIP_DEFLATED) as bundle:
            _add_tree(bundle, model_dir, ".", results_dir)
            for include in includes:
                if include.is_dir():
                    _add_tree(bundle, include, include.name, results_dir)
                else:
                    bundle.write(include, include.name)
        spooled.seek(0)
        return spooled.read()


def unpack(archive: bytes, directory: Path) -> None:
    """``archive`` into ``directory``, with each file's permissions (an entrypoint may be an
    executable script)."""
    with zipfile.ZipFile(io.BytesIO(archive)) as bundle:
        for info in bundle.infolist():
            path = bundle.extract(info, directory)
            mode = (info.external_attr >> 16) & 0o777
            # Writable by its owner: a read-only model dir's copy must take the trial's files.
            if mode:
                os.chmod(path, mode | stat.S_IWUSR)
