"""Reads a TensorBoard run folder with the tensorboard package's own event-file reader (which
checks every record's CRC) and prints what it holds as JSON: the scalars by tag as [step, value]
pairs, the text summaries, and the steps of session starts. Run by bench/.venv's Python.

usage: read_tensorboard.py RUN_DIR
"""
import glob
import json
import os
import sys

from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from tensorboard.util import tensor_util


def main(run_dir):
    scalars, texts, session_starts, files = {}, {}, [], sorted(glob.glob(os.path.join(run_dir, "events.out.tfevents.*")))
    versions = []
    for path in files:
        for event in LegacyEventFileLoader(path).Load():
            if event.HasField("file_version"):
                versions.append(event.file_version)
            if event.HasField("session_log"):
                session_starts.append([event.step, event.session_log.status])
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append([event.step, value.simple_value])
                elif value.metadata.plugin_data.plugin_name == "text":
                    texts[value.tag] = tensor_util.make_ndarray(value.tensor).item().decode()
    print(json.dumps({"files": len(files), "file_versions": versions, "scalars": scalars, "texts": texts,
                      "session_starts": session_starts}))


if __name__ == "__main__":
    main(sys.argv[1])
