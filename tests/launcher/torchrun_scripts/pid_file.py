# Shared by the torchrun test scripts: writes "PID STARTTIME" to a file, whole.
import os


def write_pid_file(path):
    """The pid and its start time (/proc/self/stat field 22), which tells
    this process from a later one that takes the same pid; written to a
    temp file and renamed, so the test never reads a half-filled one."""
    with open("/proc/self/stat") as stat:
        started = stat.read().rsplit(")", 1)[1].split()[19]
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {started}")
    os.replace(path + ".tmp", path)
