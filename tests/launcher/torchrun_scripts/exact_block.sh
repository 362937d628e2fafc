#!/bin/sh
# Exactly 64 KiB without an end of line, then the end of the script: the
# last piece of output is a whole message with nothing after it.
head -c 65536 /dev/zero | tr '\0' x
