"""Where the repository and the test writers lie: tests start processes from the repository's root."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
WRITERS = ROOT / "tests" / "writers"
HELPERS = ROOT / "tests" / "helpers"
