#!/bin/sh
# A rank that is not Python (troupe torchrun --no-python): says where it is.
echo "rank $RANK of $WORLD_SIZE, local rank $LOCAL_RANK, args $*"
