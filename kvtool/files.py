"""Files kvtool writes whole or not at all."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


def write_json_atomically(path: Path, content: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    staging.write_text(json.dumps(content, indent=2) + "\n")
    os.replace(staging, path)
