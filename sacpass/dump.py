"""Graph dumps: per compiled graph, the tagged joint graph, the forward and backward graphs, the report.

Layout::

    DIR/index.json            {"kind": "sacpass.dump", "version": 1, "graphs": ["g0", ...]}
    DIR/g0/joint.txt          joint graph with sacpass/PyTorch tags (before the min-cut)
    DIR/g0/forward.txt        forward graph (print_readable)
    DIR/g0/backward.txt       backward graph (print_readable)
    DIR/g0/report.json        the saved-set report (Report.to_json)

Everything is text or JSON: dumps are read back with json only, never pickle.
"""
from __future__ import annotations

import json
import os

from .errors import DumpError

__all__ = ["Dumper", "DUMP_VERSION"]

DUMP_VERSION = 1


def _readable(gm) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


class Dumper:
    """Writes dumps into one directory; checks at construction that it can."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = os.fspath(directory)
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, ".sacpass-write-test")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            raise DumpError(
                f"sacpass: dump_dir {self.dir!r} cannot be written ({e.strerror or e}). Pass a writable "
                f"directory as dump_dir= (or SACPASS_DUMP_DIR), or leave it unset to dump nothing.") from e
        self.graphs: list[str] = []

    def write(self, result) -> str:
        """Write one PartitionResult; returns its folder."""
        gid = result.report.graph
        folder = os.path.join(self.dir, gid)
        try:
            os.makedirs(folder, exist_ok=True)
            files = {
                "joint.txt": result.joint_text,
                "forward.txt": _readable(result.forward),
                "backward.txt": _readable(result.backward),
                "report.json": result.report.to_json(),
            }
            for name, text in files.items():
                with open(os.path.join(folder, name), "w") as f:
                    f.write(text)
            if gid not in self.graphs:
                self.graphs.append(gid)
            with open(os.path.join(self.dir, "index.json"), "w") as f:
                json.dump({"kind": "sacpass.dump", "version": DUMP_VERSION, "graphs": self.graphs}, f, indent=1)
        except OSError as e:
            raise DumpError(f"sacpass: could not write dump {folder!r} ({e}). Free space or pick another "
                            f"dump_dir.") from e
        return folder
