"""
common.py: the one lock (train.lock, prepare.lock) and the process helpers.
"""

import json
import os
import socket

import common


def test_lock_holder_reads_another_users_process_as_alive(tmp_path, monkeypatch):
    """A lock's holder (common.lock_holder, train.lock's and prepare.lock's alike): gone (no such process) -> None;
    another user's live process (signalling it is refused) or a process on another host -> the holder: the folder
    stays refused."""
    lock = tmp_path / "prepare.lock"
    lock.write_text(json.dumps({"pid": 4242, "host": socket.gethostname(), "by": "prepare_data.py"}))
    for error, alive in ((ProcessLookupError, False), (PermissionError, True)):
        def kill(pid, sig, error=error):
            raise error
        monkeypatch.setattr(os, "kill", kill)
        assert (common.lock_holder(str(lock)) is not None) == alive and common.pid_alive(4242) == alive
    lock.write_text(json.dumps({"pid": 4242, "host": "another-host"}))
    assert common.lock_holder(str(lock))["pid"] == 4242
