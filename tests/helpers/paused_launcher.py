"""`python -m launcher`, its ranks paused as tests/helpers/paused_merger.py pauses `python -m merger`.

With the environment paused_merger.py reads (MERGER_TEST_PAUSE_AFTER_BATCH, MERGER_TEST_PAUSE_FILE), a test stops
a real `launcher local` merge at a known batch and then signals the launcher. `launcher local` forks its ranks
from its own process, so the pause is set up here, before they start; the launcher's own code, what it passes on
and when, is what runs.
"""
import sys

from launcher.cli import main
from tests.helpers.paused_merger import pause_as_the_environment_says

if __name__ == "__main__":
    pause_as_the_environment_says()
    sys.exit(main())
