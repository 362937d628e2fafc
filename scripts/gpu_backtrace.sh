#!/usr/bin/env bash
# Runs a program under gdb (or cuda-gdb, which the GPU machines carry instead
# of gdb) in batch mode and prints every thread's backtrace if it stops on a
# fatal signal: for crashes seen only on a lent GPU machine, where there is
# no time for an interactive session.
#
#   scripts/gpu_backtrace.sh PROGRAM [ARGS...]
#
# The process's own signals (SIGPIPE, SIGCHLD, SIGUSR1/2, SIGTERM) pass
# through without stopping; child processes are not followed.
set -euo pipefail
dbg=$(command -v gdb || command -v cuda-gdb || true)
[[ -n $dbg ]] || { echo "gpu_backtrace: no gdb or cuda-gdb on PATH" >&2; exit 2; }
exec "$dbg" -q -batch -nx \
  -ex 'set pagination off' -ex 'set confirm off' \
  -ex 'set follow-fork-mode parent' -ex 'set detach-on-fork on' \
  -ex 'handle SIGPIPE SIGCHLD SIGUSR1 SIGUSR2 SIGTERM SIGINT nostop noprint pass' \
  -ex run -ex 'thread apply all bt 30' \
  --args "$@"
