"""Tensor parallelism: the process group (group.py), its peer-memory collectives (collectives.py),
the step mailbox and message (mailbox.py, channel.py), and the ranks' processes (worker.py)."""
