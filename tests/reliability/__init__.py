"""Reliability and security tests (issue 6). The mutation machinery lives in fuzz/ at the top of
the repository, shared with the long fuzz run (python -m fuzz.run); it is made importable here."""
import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:
    sys.path.append(_REPO)
