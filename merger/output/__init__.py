"""The output: staged files written at planned offsets (files.py), checksums and resume (resume.py), the target
and its lock (target.py, target_lock.py), the summary and publishing to the Hub."""
