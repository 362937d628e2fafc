#!/bin/sh
# One line of 200000 'x' (written in several pieces), then " rank N" and
# its end: longer than one output message carries.
head -c 200000 /dev/zero | tr '\0' x
echo " rank $RANK"
